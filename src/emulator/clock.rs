//! The emulators' clock (the pipeline's [`crate::clock::Clock`], which tests advance so
//! scheduled messages, lock expiry and duplicate-detection windows need no real waits) and
//! the HTTP date format.

/// The clock the emulators and the pipeline share ([`crate::clock::Clock`]), and the HTTP
/// date format, which live with the rest of time in [`crate::clock`].
pub use crate::clock::{http_date, parse_http_date, Clock};
