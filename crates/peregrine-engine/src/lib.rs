//! Peregrine's generation engine: tokenizers, chat templates, incremental detokenization, stop
//! strings and the request/event API that the server uses.

pub mod chat_template;
pub mod detok;
pub mod stop;
pub mod tokenizer;
