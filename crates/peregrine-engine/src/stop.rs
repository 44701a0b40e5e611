//! stop (in progress)
