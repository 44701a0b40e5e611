//! detok (in progress)
