//! peregrine-engine
