//! Mixture-of-experts machinery that does not depend on a model: routing a token to its top-k
//! experts ([`Router`]) and the seam through which an MoE block reaches its experts
//! ([`ExpertStore`]).
//!
//! The MoE block never learns where an expert lives: [`ResidentExperts`] keeps every expert in
//! memory; [`StreamedExperts`] reads each from disk when it is used (models larger than
//! memory), through the same trait, without touching model code. Routing writes into the caller's buffers so that a decode step
//! allocates nothing.
#![warn(missing_docs)]

mod router;
mod store;
mod streamed;

pub use router::{Router, Scoring};
pub use store::{ExpertStore, ResidentExperts, tokens_by_expert};
pub use streamed::{ExpertCheck, ExpertReader, ReadPool, StreamStats, StreamedExperts};

// The README's examples compile and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
