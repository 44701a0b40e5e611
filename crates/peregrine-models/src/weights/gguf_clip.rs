//! HF tensor names of vision towers and projectors mapped to their names in llama.cpp's
//! multimodal projector files (`--mmproj`), as its converter writes them.

/// The name in a llama.cpp multimodal projector file (`general.architecture` `clip`, what
/// `--mmproj` reads) of an HF name of a SigLIP tower (Gemma 3's `vision_tower.vision_model.`,
/// SmolVLM's `model.vision_model.`), Gemma 3's projector (`multi_modal_projector.`) or SmolVLM's
/// connector, or of a Qwen VL's tower (`visual.`: [`qwen_clip_name`]).
pub(super) fn clip_name(hf: &str) -> Option<String> {
    if let Some(rest) = hf.strip_prefix("visual.") {
        return qwen_clip_name(rest);
    }
    if let Some(rest) = hf.strip_prefix("model.vision_tower.") {
        return gemma4_clip_name(rest);
    }
    if hf == "model.embed_vision.embedding_projection.weight" {
        return Some("mm.input_projection.weight".to_string());
    }
    if let Some(rest) = hf.strip_prefix("multi_modal_projector.") {
        let name = match rest {
            "mm_input_projection_weight" => "mm.input_projection.weight",
            "mm_soft_emb_norm.weight" => "mm.soft_emb_norm.weight",
            // Mistral 3's
            "norm.weight" => "mm.input_norm.weight",
            "patch_merger.merging_layer.weight" => "mm.patch_merger.weight",
            "linear_1.weight" => "mm.1.weight",
            "linear_1.bias" => "mm.1.bias",
            "linear_2.weight" => "mm.2.weight",
            "linear_2.bias" => "mm.2.bias",
            _ => return None,
        };
        return Some(name.to_string());
    }
    if let Some(rest) = hf.strip_prefix("vision_tower.")
        && !rest.starts_with("vision_model.")
    {
        return pixtral_clip_name(rest);
    }
    if hf == "model.connector.modality_projection.proj.weight" {
        return Some("mm.model.fc.weight".to_string());
    }
    let rest = (hf.strip_prefix("vision_tower.vision_model."))
        .or_else(|| hf.strip_prefix("model.vision_model."))?;
    let whole = match rest {
        "embeddings.patch_embedding.weight" => Some("v.patch_embd.weight"),
        "embeddings.patch_embedding.bias" => Some("v.patch_embd.bias"),
        "embeddings.position_embedding.weight" => Some("v.position_embd.weight"),
        "post_layernorm.weight" => Some("v.post_ln.weight"),
        "post_layernorm.bias" => Some("v.post_ln.bias"),
        _ => None,
    };
    if let Some(name) = whole {
        return Some(name.to_string());
    }
    let (layer, rest) = rest.strip_prefix("encoder.layers.")?.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let name = match module {
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.out_proj" => "attn_out",
        "layer_norm1" => "ln1",
        "layer_norm2" => "ln2",
        "mlp.fc1" => "ffn_up",
        "mlp.fc2" => "ffn_down",
        _ => return None,
    };
    Some(format!("v.blk.{layer}.{name}.{kind}"))
}

/// [`clip_name`] of Gemma 4's `model.vision_tower.{rest}`: the clipped linears' `linear.weight`
/// is the layer's `weight`, their ranges keep their names (`input_max`, …), the sandwich norms
/// are `ln1`, `attn_post_norm`, `ln2` and `ffn_post_norm`.
fn gemma4_clip_name(rest: &str) -> Option<String> {
    let whole = match rest {
        "patch_embedder.input_proj.weight" => Some("v.patch_embd.weight"),
        "patch_embedder.position_embedding_table" => Some("v.position_embd.weight"),
        "std_bias" => Some("v.std_bias"),
        "std_scale" => Some("v.std_scale"),
        _ => None,
    };
    if let Some(name) = whole {
        return Some(name.to_string());
    }
    let (layer, rest) = rest.strip_prefix("encoder.layers.")?.split_once('.')?;
    let rest = rest.replace(".linear.weight", ".weight");
    let (module, kind) = rest.rsplit_once('.')?;
    let name = match module {
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_out",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "input_layernorm" => "ln1",
        "post_attention_layernorm" => "attn_post_norm",
        "pre_feedforward_layernorm" => "ln2",
        "post_feedforward_layernorm" => "ffn_post_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("v.blk.{layer}.{name}.{kind}"))
}

/// [`clip_name`] of Pixtral's `vision_tower.{rest}` (Mistral 3's tower).
fn pixtral_clip_name(rest: &str) -> Option<String> {
    let whole = match rest {
        "patch_conv.weight" => Some("v.patch_embd.weight"),
        "ln_pre.weight" => Some("v.pre_ln.weight"),
        _ => None,
    };
    if let Some(name) = whole {
        return Some(name.to_string());
    }
    let (layer, rest) = rest.strip_prefix("transformer.layers.")?.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let name = match module {
        "attention.q_proj" => "attn_q",
        "attention.k_proj" => "attn_k",
        "attention.v_proj" => "attn_v",
        "attention.o_proj" => "attn_out",
        "attention_norm" => "ln1",
        "ffn_norm" => "ln2",
        "feed_forward.gate_proj" => "ffn_gate",
        "feed_forward.up_proj" => "ffn_up",
        "feed_forward.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("v.blk.{layer}.{name}.{kind}"))
}

/// [`clip_name`] of Qwen2(.5)-VL's and Qwen3-VL's `visual.{rest}`. llama.cpp's converter splits
/// Qwen2(.5)-VL's fused `attn.qkv` into `attn_q` / `attn_k` / `attn_v` (HF-named here `attn.q`,
/// `attn.k`, `attn.v`; Qwen3-VL's stays `attn_qkv`) and the Conv3d's two frames into
/// `v.patch_embd.weight` and `.weight.1` (`patch_embed.proj.weight` and `.weight.1`); the
/// merger's norm is `v.post_ln`, its MLP `mm.0` / `mm.2`; a DeepStack merger is named by the
/// block it reads (`v.deepstack.{block}`, HF-named `deepstack.{block}`).
fn qwen_clip_name(rest: &str) -> Option<String> {
    let whole = match rest {
        "patch_embed.proj.weight" => Some("v.patch_embd.weight"),
        "patch_embed.proj.weight.1" => Some("v.patch_embd.weight.1"),
        "patch_embed.proj.bias" => Some("v.patch_embd.bias"),
        "pos_embed.weight" => Some("v.position_embd.weight"),
        _ => None,
    };
    if let Some(name) = whole {
        return Some(name.to_string());
    }
    let (module, kind) = rest.rsplit_once('.')?;
    let merger = match module {
        "merger.ln_q" | "merger.norm" => Some("v.post_ln"),
        "merger.mlp.0" | "merger.linear_fc1" => Some("mm.0"),
        "merger.mlp.2" | "merger.linear_fc2" => Some("mm.2"),
        _ => None,
    };
    if let Some(name) = merger {
        return Some(format!("{name}.{kind}"));
    }
    if let Some((layer, part)) = module
        .strip_prefix("deepstack.")
        .and_then(|m| m.split_once('.'))
    {
        let part = match part {
            "norm" => "norm",
            "linear_fc1" => "fc1",
            "linear_fc2" => "fc2",
            _ => return None,
        };
        return Some(format!("v.deepstack.{layer}.{part}.{kind}"));
    }
    let (layer, module) = module.strip_prefix("blocks.")?.split_once('.')?;
    let name = match module {
        "attn.q" => "attn_q",
        "attn.k" => "attn_k",
        "attn.v" => "attn_v",
        "attn.qkv" => "attn_qkv",
        "attn.proj" => "attn_out",
        "norm1" => "ln1",
        "norm2" => "ln2",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" | "mlp.fc1" | "mlp.linear_fc1" => "ffn_up",
        "mlp.down_proj" | "mlp.fc2" | "mlp.linear_fc2" => "ffn_down",
        _ => return None,
    };
    Some(format!("v.blk.{layer}.{name}.{kind}"))
}
