//! Who reads which partition: one concern, apart from the fence that guards checkpoints
//! (see [`checkpoint`](super::checkpoint)).
//!
//! - [`owner`]: one owner id, one live process (the owner record and its lease);
//! - [`handover`]: a partition a live replica owns is asked for, not stolen (the handover
//!   request records);
//! - [`plan`]: what a cycle claims, asks for or takes — share, ask, take, the owner lease's
//!   gate — as a pure function of the listing, this replica, the live replicas and the time;
//! - [`cooperate`]: the calls that carry a plan's asks out and answer other replicas'
//!   requests, each within a deadline.
//!
//! The fenced store asks the plan, makes the calls, and keeps each partition's state.

pub(super) mod cooperate;
pub(super) mod handover;
pub mod owner;
pub(super) mod plan;
