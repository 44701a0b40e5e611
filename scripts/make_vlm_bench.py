"""A random-weight Gemma 3 VLM of real shapes for the vision benchmark (benches/vision.rs):
Gemma 3 4B's vision tower and projector (SigLIP-So400m at 896x896: 27 layers, width 1152, 4096
patches pooled to 256 image tokens) in front of Gemma 3 270M's text model (18 layers, width 640),
saved as bf16 safetensors with the fixture's tokenizer and processor files (vocab 262144 is
replaced by the fixture tokenizer's 512 ids, which only changes the output head's size).

usage: .venv-fixtures/bin/python scripts/make_vlm_bench.py OUT_DIR   (about 1 GB; 1-2 minutes)"""
import json, os, shutil, sys

import torch
import transformers

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "vlm", "gemma3", "hf")


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
    main(sys.argv[1])
