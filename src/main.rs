//! The `hubguard` binary: parse the command line and hand over to the library.

/// mimalloc instead of the system allocator: a profile of the retry drain at Azure's
/// latencies (`hubguard bench --profile azure`) spent about a third of the process's time in
/// glibc's `malloc`/`free` and waiting on its arena locks across the runtime's threads.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    hubguard::cli::main()
}
