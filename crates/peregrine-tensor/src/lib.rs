//! peregrine-tensor
