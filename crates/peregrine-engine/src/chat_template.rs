//! chat_template (in progress)
