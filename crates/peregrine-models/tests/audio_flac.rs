//! FLAC decoding against the WAV decoder on files libsndfile wrote
//! (`tests/fixtures/audio/flac`, scripts/fixtures/make_flac.py): a lossless copy of the speech
//! fixture decodes to its samples exactly, and a stereo 24-bit pair (two tones) to the same
//! averaged samples; broken files and clips over the limit are errors.

mod common;

use peregrine_models::audio::{decode_flac, decode_wav};

fn read(name: &str) -> Vec<u8> {
    std::fs::read(common::fixture("audio").join(name)).unwrap()
}

#[test]
fn flac_decodes_to_the_wavs_samples() {
    let wav = decode_wav(&read("qwen2_audio/speech.wav"), 30.0).unwrap();
    let flac = decode_flac(&read("flac/speech.flac"), 30.0).unwrap();
    assert_eq!(
        (flac.rate, flac.samples.len()),
        (wav.rate, wav.samples.len())
    );
    assert!(flac.samples == wav.samples, "the same samples, bit for bit");

    let wav = decode_wav(&read("flac/stereo.wav"), 30.0).unwrap();
    let flac = decode_flac(&read("flac/stereo.flac"), 30.0).unwrap();
    assert_eq!((flac.rate, flac.samples.len()), (22050, 2205));
    assert!(flac.samples == wav.samples, "24-bit stereo averaged alike");
    // Averaged, not one channel: the tones' 0.6 + 0.3 peaks never reach 0.6 together.
    let peak = flac.samples.iter().fold(0.0f32, |m, s| m.max(s.abs()));
    assert!(peak > 0.3 && peak < 0.45, "{peak}");
}

#[test]
fn bad_flac_files_are_errors() {
    let good = read("flac/speech.flac");
    assert!(decode_flac(b"fLaC", 30.0).is_err());
    assert!(decode_flac(b"not audio at all", 30.0).is_err());
    assert!(
        decode_flac(&read("qwen2_audio/speech.wav"), 30.0).is_err(),
        "a WAV is not FLAC"
    );
    assert!(
        decode_flac(&good[..good.len() / 2], 30.0).is_err(),
        "cut short"
    );
    let err = decode_flac(&good, 1.0).unwrap_err().to_string();
    assert!(err.contains("longer than 1 s"), "{err}");
}
