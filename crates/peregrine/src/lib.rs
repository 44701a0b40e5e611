//! peregrine
