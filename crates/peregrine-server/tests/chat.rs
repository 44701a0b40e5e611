//! `peregrine chat` driven through a real terminal (tmux): two turns, Ctrl-C mid-reply,
//! `/clear`, Ctrl-D; the transcript is checked against the engine's own greedy replies.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use peregrine_engine::{ChatMessage, Engine, EngineConfig, Event, KvOptions, Prompt, Request};

/// A tmux session running one command; killed on drop.
struct Terminal(String);

impl Terminal {
    fn start(command: &str) -> Self {
        let name = format!("peregrine-chat-test-{}", std::process::id());
        let status = Command::new("tmux")
            .args([
                "new-session",
                "-d",
                "-s",
                &name,
                "-x",
                "160",
                "-y",
                "50",
                command,
            ])
            .status()
            .expect("tmux runs (Debian's tmux package; the test needs a terminal)");
        assert!(status.success());
        Self(name)
    }

    fn keys(&self, keys: &[&str]) {
        let status = Command::new("tmux")
            .args(["send-keys", "-t", &self.0])
            .args(keys)
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// The whole pane, wrapped lines joined.
    fn screen(&self) -> String {
        let out = Command::new("tmux")
            .args(["capture-pane", "-p", "-J", "-S", "-", "-t", &self.0])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits until `done` holds for the screen (60 s at most).
    fn wait(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let screen = self.screen();
            if done(&screen) {
                return screen;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{what}:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.0])
            .status();
    }
}

/// Lines that are prompts waiting for input.
fn prompts(screen: &str) -> usize {
    screen.lines().filter(|l| l.trim_end() == ">").count()
}

fn greedy(engine: &Engine, messages: &[ChatMessage]) -> String {
    let mut request = Request::new(Prompt::Chat {
        messages: messages.to_vec(),
        template_kwargs: Default::default(),
    });
    request.max_tokens = Some(400);
    request.sampling.temperature = 0.0;
    let events = engine.submit(request).unwrap();
    events
        .filter_map(|e| match e {
            Event::Delta { text, .. } => Some(text),
            _ => None,
        })
        .collect()
}

#[test]
fn chat_streams_stops_clears_and_leaves() {
    let model = support::real_model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let bin = env!("CARGO_BIN_EXE_peregrine");
    let command = format!(
        "{bin} chat --model {} --temperature 0 --max-tokens 400; echo EXITED $?; sleep 60",
        model.display()
    );
    let term = Terminal::start(&command);
    term.wait("the chat starts", |s| {
        s.contains("Ctrl-D to leave") && prompts(s) == 1
    });

    term.keys(&["Name three colors.", "Enter"]);
    let screen = term.wait("the first reply ends", |s| {
        prompts(s) == 1 && s.matches("> ").count() >= 2
    });
    // The chat's KV cache is the CLI's default, f16: the same here, or near-ties may differ.
    let kv = KvOptions {
        dtype: Some(peregrine_engine::tensor::DType::F16),
        ..KvOptions::default()
    };
    let config = EngineConfig {
        kv,
        ..EngineConfig::default()
    };
    let engine = Engine::load(&model, config).unwrap();
    let question = [ChatMessage::text("user", "Name three colors.")];
    let first = greedy(&engine, &question);
    assert!(
        screen.contains(&format!("> Name three colors.\n{first}\n> ")),
        "{screen}\n---\n{first}"
    );
    term.keys(&["/stats", "Enter"]);
    let screen = term.wait("/stats answers", |s| s.contains("prompt tokens ("));
    let stats = |screen: &str, nth: usize| -> String {
        let line = screen
            .lines()
            .filter(|l| l.contains("prompt tokens ("))
            .nth(nth)
            .unwrap();
        line.split(" prompt tokens")
            .next()
            .unwrap()
            .trim_start_matches('[')
            .to_string()
    };
    let first_prompt_tokens = stats(&screen, 0);

    term.keys(&["Write a very long story about a dragon.", "Enter"]);
    term.wait("the story streams", |s| {
        s.split("dragon.\n")
            .nth(1)
            .is_some_and(|story| story.len() > 80)
    });
    term.keys(&["C-c"]);
    let screen = term.wait("Ctrl-C stops the reply", |s| s.contains("[stopped]\n>"));
    assert!(
        !screen.contains("EXITED"),
        "Ctrl-C left the chat:\n{screen}"
    );

    term.keys(&["/clear", "Enter"]);
    term.wait("/clear answers", |s| s.contains("[conversation cleared]"));
    // A cleared conversation is a fresh one: the same question is the same prompt. (Its reply
    // is not compared: the prompt cache now supplies all but the last prompt token, and a
    // one-token prefill is not bit-identical to a whole one, so a near tie may go either way.)
    term.keys(&["Name three colors.", "Enter"]);
    term.wait("the third reply ends", |s| {
        (s.split("[conversation cleared]").nth(1))
            .is_some_and(|rest| rest.matches("\n> ").count() >= 2)
    });
    term.keys(&["/stats", "Enter"]);
    let screen = term.wait("/stats answers again", |s| {
        s.matches("prompt tokens (").count() == 2
    });
    assert_eq!(stats(&screen, 1), first_prompt_tokens, "{screen}");

    term.keys(&["C-d"]);
    term.wait("Ctrl-D leaves with status 0", |s| s.contains("EXITED 0"));
}
