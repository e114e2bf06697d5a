//! Where the logs of what a test starts go: the processes (`hubguard run`, Prometheus) into a
//! file each, and the pipelines running in this process into one file for the binary — under
//! the target directory's `tmp/test-logs/`, never to the terminal. When a test fails, its
//! logs are printed with their paths (as part of the test's captured output, so the runner
//! shows them under the failure); a test that passes prints nothing.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Stdio;

/// At most this much of a log is printed (its end: where a failure shows).
const PRINT_LIMIT: u64 = 256 * 1024;

/// The folder of the logs.
pub(crate) fn dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("test-logs");
    std::fs::create_dir_all(&d).expect("create the test-logs folder");
    d
}

/// The file the pipelines of this test binary log to (see `otlp::telemetry`).
pub(crate) fn in_process_path() -> PathBuf {
    dir().join("in-process.log")
}

/// A log printed, with its path, when the test that holds it fails.
pub(crate) struct TestLog {
    what: String,
    path: PathBuf,
    /// Where this test's part of a shared file begins.
    from: u64,
}

impl TestLog {
    /// A fresh file for `name` (a test and what it starts, e.g. `alerts-hubguard`).
    pub(crate) fn file(name: &str) -> Self {
        let path = dir().join(format!("{name}.log"));
        File::create(&path).expect("create a test log");
        Self {
            what: name.to_string(),
            path,
            from: 0,
        }
    }

    /// The in-process log from now on (the file is shared by the tests running at once, so
    /// the part printed may hold other tests' lines too).
    pub(crate) fn in_process() -> Self {
        let path = in_process_path();
        let from = std::fs::metadata(&path).map_or(0, |m| m.len());
        Self {
            what: "the pipelines in this process".into(),
            path,
            from,
        }
    }

    /// The file, appended to, as a child's stdout or stderr.
    pub(crate) fn stdio(&self) -> Stdio {
        OpenOptions::new()
            .append(true)
            .open(&self.path)
            .expect("open a test log")
            .into()
    }

    /// Where it is.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    fn tail(&self) -> String {
        let Ok(mut f) = File::open(&self.path) else {
            return "(no log written)".into();
        };
        let end = f.metadata().map_or(0, |m| m.len());
        let start = self.from.max(end.saturating_sub(PRINT_LIMIT));
        let _ = f.seek(SeekFrom::Start(start));
        let mut bytes = Vec::new();
        let _ = f.read_to_end(&mut bytes);
        let text = String::from_utf8_lossy(&bytes).into_owned();
        if start > self.from {
            format!("(… the last {PRINT_LIMIT} bytes)\n{text}")
        } else {
            text
        }
    }
}

impl TestLog {
    /// What a failing test prints: the log's path and its end.
    fn failure_report(&self) -> String {
        format!(
            "---- log of {} ({}) ----\n{}\n---- end of {} ----",
            self.what,
            self.path.display(),
            self.tail(),
            self.path.display()
        )
    }
}

impl Drop for TestLog {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.failure_report());
        }
    }
}

#[test]
fn a_failing_test_reports_its_log_with_its_path() {
    let log = TestLog::file("test_log-self-check");
    std::fs::write(
        log.path(),
        "first line\nthe line that explains the failure\n",
    )
    .unwrap();
    let report = log.failure_report();
    assert!(
        report.contains(&log.path().display().to_string())
            && report.contains("the line that explains the failure"),
        "{report}"
    );
    // The in-process log reports only what was written after the test began.
    let shared = TestLog {
        what: "shared".into(),
        path: log.path().to_path_buf(),
        from: "first line\n".len() as u64,
    };
    let report = shared.failure_report();
    assert!(!report.contains("first line"), "{report}");
}

/// The pipelines running in the test process log to the file, not to the terminal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pipelines_in_the_test_process_log_to_a_file() {
    use crate::pipeline_support::*;
    crate::otlp::telemetry();
    let before = std::fs::metadata(in_process_path()).map_or(0, |m| m.len());
    let bed = Bed::start(1).await;
    bed.send(0, &[("quiet-1", "ok")]).await;
    let handler = std::sync::Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(3), "replica-quiet"));
    wait_for(
        "delivered",
        &run.health,
        std::time::Duration::from_secs(60),
        || async { handler.delivered_keys().contains("quiet-1") },
    )
    .await;
    run.stop().await;
    let mut f = File::open(in_process_path()).expect("the in-process log exists");
    f.seek(SeekFrom::Start(before)).unwrap();
    let mut text = String::new();
    f.read_to_string(&mut text).unwrap();
    assert!(
        text.contains("partition claimed"),
        "the pipeline's log lines are in {}: {text}",
        in_process_path().display()
    );
}
