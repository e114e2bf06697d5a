//! Locks that outlive a panic: a poisoned mutex guards data a panicking thread left as it
//! was (hubguard's locked sections only assign), so every lock is taken whatever became of
//! its last holder ([`LockExt::locked`]), in one place instead of at each call.

use std::sync::{Mutex, MutexGuard};

/// [`Mutex::lock`], taking the guard of a poisoned mutex too.
pub(crate) trait LockExt<T: ?Sized> {
    /// The guard, poisoned or not.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> LockExt<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|p| p.into_inner())
    }
}
