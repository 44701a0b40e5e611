//! peregrine-models
