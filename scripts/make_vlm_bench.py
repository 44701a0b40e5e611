"""A random-weight Gemma 3 VLM of real shapes for the vision benchmark (benches/vision.rs):
Gemma 3 4B's vision tower and projector (SigLIP-So400m at 896x896: 27 layers, width 1152, 4096
patches pooled to 256 image tokens) in front of Gemma 3 270M's text model (18 layers, width 640),
saved as bf16 safetensors with the fixture's tokenizer and processor files (vocab 262144 is
replaced by the fixture tokenizer's 512 ids, which only changes the output head's size).

With `qwen2_5_vl`: Qwen2.5-VL-3B's vision tower (32 blocks of width 1280, window attention with
full attention in blocks 7/15/23/31, 2×2 patch merger) in front of Qwen2.5-0.5B's text model (24
layers, width 896, head width 64, so M-RoPE sections 8/12/12; the merger's output width is 896
instead of 3B's 2048), the fixture's
tokenizer and the processor's default pixel limits.

usage: .venv-fixtures/bin/python scripts/make_vlm_bench.py OUT_DIR [gemma3|qwen2_5_vl]
(about 1 GB / 2.6 GB; 1-3 minutes)"""
import json, os, shutil, sys

import torch
import transformers

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "vlm", "gemma3", "hf")
QWEN = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "vlm", "qwen2_5_vl", "hf")
FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
         "processor_config.json", "generation_config.json"]


def randomize(model):
    with torch.no_grad():   # random init leaves norms at 1 and biases at 0: fine for timing
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)


def qwen(out):
    """Qwen2.5-VL-3B's tower before Qwen2.5-0.5B's text model, saved in the hub layout."""
    os.makedirs(out, exist_ok=True)
    base = json.load(open(os.path.join(QWEN, "config.json")))
    vision = dict(base["vision_config"], depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                  out_hidden_size=896, fullatt_block_indexes=[7, 15, 23, 31], window_size=112)
    text = {k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "rms_norm_eps")}
    text.update(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}, layer_types=None)
    cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                        **{k: base[k] for k in ("image_token_id", "video_token_id",
                                                                 "vision_start_token_id", "vision_end_token_id")})
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).to(torch.bfloat16).eval()
    randomize(model)
    model.save_pretrained(out, safe_serialization=True)
    for f in FILES:
        shutil.copy(os.path.join(QWEN, f), out)
    pre = json.load(open(os.path.join(QWEN, "preprocessor_config.json")))
    pre.update(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    json.dump(pre, open(os.path.join(out, "preprocessor_config.json"), "w"), indent=2)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n / 1e6:.0f}M parameters")


def main(out):
    os.makedirs(out, exist_ok=True)
    base = json.load(open(os.path.join(FIXTURE, "config.json")))
    text = dict(base["text_config"], hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                sliding_window=512, layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                                 for i in range(18)])
    vision = dict(base["vision_config"], hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                  num_attention_heads=16, image_size=896, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=256,
                                    boi_token_index=base["boi_token_index"],
                                    eoi_token_index=base["eoi_token_index"],
                                    image_token_index=base["image_token_index"], tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():   # random init leaves norms at 1 and biases at 0: fine for timing
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    model.save_pretrained(out, safe_serialization=True)
    # Hub layout: the tower under `vision_tower.vision_model.` (as the fixture).
    from safetensors.torch import load_file, save_file
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            path = os.path.join(out, name)
            sd = load_file(path)
            sd = {("vision_tower.vision_model." + k[len("vision_tower."):]
                   if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
                  for k, v in sd.items()}
            save_file(sd, path, metadata={"format": "pt"})
    for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "processor_config.json", "generation_config.json"]:
        shutil.copy(os.path.join(FIXTURE, f), out)
    pre = json.load(open(os.path.join(FIXTURE, "preprocessor_config.json")))
    pre.update(size={"height": 896, "width": 896}, image_seq_length=256)
    json.dump(pre, open(os.path.join(out, "preprocessor_config.json"), "w"), indent=2)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n / 1e6:.0f}M parameters")


if __name__ == "__main__":
    (qwen if sys.argv[2:] == ["qwen2_5_vl"] else main)(sys.argv[1])
