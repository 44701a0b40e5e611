//! peregrine-sampling
