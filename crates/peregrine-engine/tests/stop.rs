//! Stop strings over chunked text.

use peregrine_engine::stop::{StopMatcher, StopStep};

fn matcher(stops: &[&str]) -> StopMatcher {
    StopMatcher::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>())
}

/// Feeds `chunks`, returning everything emitted (including the final flush) and whether it
/// stopped.
fn run(stops: &[&str], chunks: &[&str]) -> (String, bool) {
    let mut m = matcher(stops);
    let mut out = String::new();
    for c in chunks {
        let StopStep { emit, stopped } = m.push(c);
        out.push_str(&emit);
        if stopped {
            return (out, true);
        }
    }
    out.push_str(&m.finish());
    (out, false)
}

#[test]
fn stop_across_chunk_boundaries() {
    let mut m = matcher(&["</answer>"]);
    assert_eq!(
        m.push("The result is 4</"),
        StopStep {
            emit: "The result is 4".into(),
            stopped: false
        }
    );
    assert_eq!(
        m.push("ans"),
        StopStep {
            emit: "".into(),
            stopped: false
        }
    );
    assert_eq!(
        m.push("wer> trailing"),
        StopStep {
            emit: "".into(),
            stopped: true
        }
    );
    assert!(m.is_stopped());
    assert_eq!(m.matched(), Some("</answer>"));
    assert_eq!(
        m.push("more"),
        StopStep {
            emit: "".into(),
            stopped: true
        }
    );
    assert_eq!(m.finish(), "");
}

#[test]
fn text_before_the_stop_in_the_same_chunk_is_emitted() {
    assert_eq!(run(&["STOP"], &["abcSTOPdef"]), ("abc".into(), true));
    assert_eq!(run(&["\n\n"], &["line\n", "\nnext"]), ("line".into(), true));
}

#[test]
fn false_start_is_released() {
    let mut m = matcher(&["<end>"]);
    assert_eq!(m.push("a <e").emit, "a ");
    assert_eq!(m.push("x").emit, "<ex");
    assert_eq!(m.push("<").emit, "");
    assert_eq!(m.push("<en").emit, "<");
    assert_eq!(m.finish(), "<en");
}

#[test]
fn overlapping_stops_first_to_complete_wins() {
    // "bc" completes before "abcd" could: chunking does not change the answer.
    assert_eq!(run(&["abcd", "bc"], &["abcd"]), ("a".into(), true));
    assert_eq!(
        run(&["abcd", "bc"], &["a", "b", "c", "d"]),
        ("a".into(), true)
    );
    // Same end: the earlier (longer) one wins.
    assert_eq!(run(&["xabc", "bc"], &["zxabc"]), ("z".into(), true));
    assert_eq!(
        run(&["xabc", "bc"], &["z", "x", "a", "b", "c"]),
        ("z".into(), true)
    );
    // One stop's suffix is another's prefix.
    assert_eq!(run(&["aab"], &["a", "a", "a", "b"]), ("a".into(), true));
}

#[test]
fn stop_that_never_completes_is_flushed() {
    assert_eq!(
        run(&["<|im_end|>"], &["done <|im", "_en"]),
        ("done <|im_en".into(), false)
    );
}

#[test]
fn empty_stop_list_passes_through() {
    let mut m = matcher(&[]);
    assert_eq!(
        m.push("anything <"),
        StopStep {
            emit: "anything <".into(),
            stopped: false
        }
    );
    assert_eq!(m.finish(), "");
    // Empty stop strings are ignored rather than matching everywhere.
    assert_eq!(run(&[""], &["abc"]), ("abc".into(), false));
}

#[test]
fn multibyte_characters_are_held_whole() {
    let mut m = matcher(&["🦀🦀", "éé"]);
    assert_eq!(m.push("x🦀").emit, "x");
    assert_eq!(m.push("é").emit, "🦀");
    assert!(m.push("é").stopped);
    assert_eq!(run(&["éa"], &["éé", "b"]), ("ééb".into(), false));
    assert_eq!(run(&["你好"], &["说你", "好吗"]), ("说".into(), true));
}

#[test]
fn chunking_never_changes_the_output() {
    let stops = ["<|end|>", "\n\nUser:", "ab"];
    let text = "Hello <|en <|e\n\nUse a\n\nUser: b";
    let whole = run(&stops, &[text]);
    assert_eq!(whole, ("Hello <|en <|e\n\nUse a".into(), true));
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(run(&stops, &refs), whole);
    for split in 1..text.len() {
        if text.is_char_boundary(split) {
            assert_eq!(
                run(&stops, &[&text[..split], &text[split..]]),
                whole,
                "split at {split}"
            );
        }
    }
}

/// The matcher against the definition, on random text over a small alphabet (so that stop
/// strings overlap themselves and each other): after every push, everything emitted so far is
/// the text up to the earliest-ending stop string (or, before any, the text minus the longest
/// suffix that is a proper prefix of some stop string).
#[test]
fn matches_the_definition_on_random_text() {
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }
        fn word(&mut self, len: usize) -> String {
            let alphabet = ['a', 'b', 'é'];
            (0..len)
                .map(|_| alphabet[self.below(alphabet.len())])
                .collect()
        }
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for case in 0..400 {
        let count = 1 + rng.below(3);
        let stops: Vec<String> = (0..count)
            .map(|_| {
                let len = 1 + rng.below(5);
                rng.word(len)
            })
            .collect();
        let len = rng.below(40);
        let text = rng.word(len);
        let mut m = StopMatcher::new(&stops);
        let (mut seen, mut emitted, mut rest) = (String::new(), String::new(), text.as_str());
        while !rest.is_empty() {
            let mut cut = 1 + rng.below(4).min(rest.len() - 1);
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            let (chunk, tail) = rest.split_at(cut);
            rest = tail;
            seen.push_str(chunk);
            let step = m.push(chunk);
            emitted.push_str(&step.emit);
            let earliest = (stops.iter())
                .filter_map(|s| seen.find(s.as_str()).map(|at| (at + s.len(), at)))
                .min_by_key(|&(end, at)| (end, at));
            if let Some((_, at)) = earliest {
                assert!(step.stopped, "case {case}: {stops:?} in {seen:?}");
                assert_eq!(emitted, seen[..at], "case {case}: {stops:?}");
                break;
            }
            let held = (0..=seen.len())
                .filter(|&i| seen.is_char_boundary(i))
                .map(|i| &seen[i..])
                .find(|tail| {
                    stops
                        .iter()
                        .any(|s| s.len() > tail.len() && s.starts_with(tail))
                })
                .map_or(0, str::len);
            assert!(!step.stopped, "case {case}");
            assert_eq!(emitted, seen[..seen.len() - held], "case {case}: {stops:?}");
        }
    }
}
