//! peregrine-kv
