//! `peregrine chat`: an interactive terminal chat. Replies stream as they are generated; the
//! conversation goes through the model's chat template each turn (the prompt cache reuses its
//! prefix). Ctrl-C stops a reply and keeps what came; Ctrl-D leaves.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use clap::Args;
use peregrine_engine::{ChatMessage, Engine, Event, Prompt, Timings, Usage};
use rustyline::DefaultEditor;
use rustyline::error::ReadlineError;

use crate::cli::{ModelArgs, SamplingArgs};

const HELP: &str = "\
/clear        start a new conversation (the system message stays)
/system TEXT  set the system message and start a new conversation
/save FILE    write the conversation as JSON
/load FILE    read a conversation written by /save
/stats        token counts and speed of the last reply
/help         this list
Ctrl-C stops a reply; Ctrl-D leaves.";

/// `peregrine chat` options.
#[derive(Debug, Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The system message.
    #[arg(long)]
    system: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
}

/// A conversation and what the last reply cost.
struct Session {
    system: Option<String>,
    turns: Vec<ChatMessage>,
    last: Option<(Usage, Timings)>,
}

impl Session {
    fn messages(&self) -> Vec<ChatMessage> {
        let system = self.system.iter().map(|s| ChatMessage::text("system", s));
        system.chain(self.turns.iter().cloned()).collect()
    }
}

/// Runs the chat until Ctrl-D or end of input.
pub fn run(args: ChatArgs) -> Result<()> {
    let engine = args.model.load()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut editor = DefaultEditor::new()?;
    let mut session = Session {
        system: args.system.clone(),
        turns: vec![],
        last: None,
    };
    eprintln!("peregrine chat: /help for commands, Ctrl-D to leave");
    loop {
        let line = match editor.readline("> ") {
            Ok(line) => line,
            Err(ReadlineError::Interrupted) => continue,
            Err(ReadlineError::Eof) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let _ = editor.add_history_entry(line);
        if let Some(command) = line.strip_prefix('/') {
            if let Err(e) = slash(command, &mut session) {
                println!("error: {e:#}");
            }
            continue;
        }
        session.turns.push(ChatMessage::text("user", line));
        let (reply, stopped) = runtime.block_on(reply(&engine, &args.sampling, &mut session))?;
        if stopped {
            println!("\n[stopped]");
        }
        session.turns.push(ChatMessage::text("assistant", reply));
    }
}

/// Streams one reply; Ctrl-C ends it early. Returns the text and whether it was stopped.
async fn reply(
    engine: &Engine,
    sampling: &SamplingArgs,
    session: &mut Session,
) -> Result<(String, bool)> {
    let request = sampling.request(Prompt::Chat {
        messages: session.messages(),
        template_kwargs: Default::default(),
    });
    let mut events = engine.submit(request)?;
    let mut text = String::new();
    let mut out = std::io::stdout();
    loop {
        let event = tokio::select! {
            event = events.recv() => event,
            _ = tokio::signal::ctrl_c() => return Ok((text, true)), // dropping `events` cancels
        };
        match event {
            Some(Event::Delta { text: delta, .. }) => {
                text.push_str(&delta);
                out.write_all(delta.as_bytes())?;
                out.flush()?;
            }
            Some(Event::Done { usage, timings, .. }) => {
                println!();
                session.last = Some((usage, timings));
                return Ok((text, false));
            }
            Some(Event::Error(e)) => return Err(e.into()),
            None => return Ok((text, true)),
        }
    }
}

/// Runs a slash command (without its `/`).
fn slash(command: &str, session: &mut Session) -> Result<()> {
    let (name, rest) = command.split_once(' ').unwrap_or((command, ""));
    let rest = rest.trim();
    match name {
        "clear" => {
            session.turns.clear();
            println!("[conversation cleared]");
        }
        "system" => {
            session.system = (!rest.is_empty()).then(|| rest.to_string());
            session.turns.clear();
            println!("[system message set; conversation cleared]");
        }
        "save" => {
            let json = serde_json::to_string_pretty(&session.messages())?;
            std::fs::write(path(rest)?, json).with_context(|| format!("writing {rest}"))?;
            println!("[saved {} messages to {rest}]", session.messages().len());
        }
        "load" => {
            let text =
                std::fs::read_to_string(path(rest)?).with_context(|| format!("reading {rest}"))?;
            let mut messages: Vec<ChatMessage> =
                serde_json::from_str(&text).with_context(|| format!("{rest}: not a saved chat"))?;
            session.system = match messages.first() {
                Some(m) if m.role == "system" => m.content.as_str().map(str::to_string),
                _ => None,
            };
            if session.system.is_some() {
                messages.remove(0);
            }
            session.turns = messages;
            println!("[loaded {} messages from {rest}]", session.turns.len());
        }
        "stats" => match session.last {
            Some((usage, timings)) => println!(
                "[{} prompt tokens ({} from the prompt cache), {:.1} tok/s prefill; {} generated, {:.1} tok/s decode]",
                usage.prompt_tokens,
                usage.cached_tokens,
                timings.prefill_tps(usage.prompt_tokens - usage.cached_tokens),
                usage.completion_tokens,
                timings.decode_tps()
            ),
            None => println!("[no reply yet]"),
        },
        "help" => println!("{HELP}"),
        _ => println!("unknown command /{name}\n{HELP}"),
    }
    Ok(())
}

fn path(arg: &str) -> Result<&Path> {
    anyhow::ensure!(!arg.is_empty(), "give a file name");
    Ok(Path::new(arg))
}
