"""Random-weight audio-language checkpoints of real tower shapes for the audio benchmark
(benches/audio.rs), each the tiny fixture's text model, tokenizer and processor files behind a tower
of a released model's shape, saved as bf16 safetensors:

  gemma4       Gemma 4 E2B's audio tower (12 Conformer layers of width 1024, 8 heads, 128 mel bins,
               chunks of 12 with 12 positions of left context, output width 1536)
  qwen2_audio  Qwen2-Audio-7B's (Whisper-large's encoder: 32 layers of width 1280, 20 heads, 128 mel
               bins, 30-second windows)

Also writes OUT_DIR/speech30.wav: the fixture's espeak-ng speech repeated to 30 seconds.

usage: .venv-fixtures/bin/python scripts/make_audio_bench.py OUT_DIR [gemma4|qwen2_audio]
(about 0.6 GB / 1.3 GB; a minute or two)"""
import json, os, shutil, sys, wave

import torch
import transformers

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "audio")
FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
         "generation_config.json"]


def randomize(model):
    with torch.no_grad():   # random init leaves norms at 1 and biases at 0: fine for timing
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)


def make(out, family):
    src = os.path.join(FIXTURES, family, "hf")
    os.makedirs(out, exist_ok=True)
    base = json.load(open(os.path.join(src, "config.json")))
    pre = json.load(open(os.path.join(src, "preprocessor_config.json")))
    if family == "gemma4":
        base["audio_config"].update(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8,
                                    subsampling_conv_channels=[128, 32], attention_chunk_size=12,
                                    attention_context_left=13, attention_context_right=0,
                                    output_proj_dims=1536)
        pre["feature_size"] = 128
        base["text_config"]["max_position_embeddings"] = 4096   # room for 30 s (750 audio tokens)
        cfg = transformers.Gemma4Config(**{k: v for k, v in base.items() if k != "architectures"})
        cls = transformers.Gemma4ForConditionalGeneration
    else:
        base["audio_config"].update(num_mel_bins=128, d_model=1280, encoder_layers=32, encoder_attention_heads=20,
                                    encoder_ffn_dim=5120, max_source_positions=1500)
        pre.update(feature_size=128, chunk_length=30, n_samples=480000, nb_max_frames=3000)
        cfg = transformers.Qwen2AudioConfig(**{k: v for k, v in base.items() if k != "architectures"})
        cls = transformers.Qwen2AudioForConditionalGeneration
    model = cls._from_config(cfg, dtype=torch.bfloat16)
    randomize(model)
    model.save_pretrained(out, safe_serialization=True)
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump(pre, f, indent=2)
    for name in FILES:
        shutil.copy(os.path.join(src, name), out)
    # 30 seconds of the fixture's speech, for a full window
    with wave.open(os.path.join(FIXTURES, family, "speech.wav")) as w:
        params, frames = w.getparams(), w.readframes(w.getnframes())
    repeat = 30 * params.framerate * 2 // len(frames) + 1
    with wave.open(os.path.join(out, "speech30.wav"), "wb") as w:
        w.setparams(params)
        w.writeframes((frames * repeat)[:30 * params.framerate * 2 - 2 * 160])
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


if __name__ == "__main__":
    make(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "gemma4")
