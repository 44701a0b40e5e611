//! RoPE parameters from HF configs: the base, the scaling (`linear`, `llama3`, `yarn`,
//! `longrope`, Gemma 4's `proportional`; any other type is refused by name) and the partial
//! rotary factor, from transformers 5's `rope_parameters` or the legacy `rope_theta` /
//! `rope_scaling`.

use peregrine_tensor::RopeScaling;

use super::Fields;
use crate::Result;

/// RoPE base, scaling and partial rotary factor from either `rope_parameters` (transformers 5)
/// or the legacy keys. A per-layer-type `rope_parameters` (Gemma 3) contributes its
/// `full_attention` entry.
pub(super) fn rope_from_hf(fields: &Fields) -> Result<(f64, RopeScaling, f64)> {
    let params = fields.object("rope_parameters")?;
    let params = match params {
        Some(p) if p.get("full_attention").is_some() => p.object("full_attention")?,
        other => other,
    };
    let legacy = fields.object("rope_scaling")?;
    let theta = match &params {
        Some(p) => p.opt_f64("rope_theta")?,
        None => None,
    };
    let theta = theta.or(fields.opt_f64("rope_theta")?).unwrap_or(10_000.0);
    // transformers moves a top-level `partial_rotary_factor` into `rope_parameters` unless
    // that already has one.
    let partial = match &params {
        Some(p) => p.opt_f64("partial_rotary_factor")?,
        None => None,
    };
    let partial = partial
        .or(fields.opt_f64("partial_rotary_factor")?)
        .unwrap_or(1.0);
    let Some(scaling) = params.or(legacy) else {
        return Ok((theta, RopeScaling::None, partial));
    };
    let scaling = rope_scaling_in(&scaling, Some(fields))?;
    // Proportional RoPE carries its own rotated fraction over the whole head.
    let partial = match scaling {
        RopeScaling::Proportional { .. } => 1.0,
        _ => partial,
    };
    Ok((theta, scaling, partial))
}

/// Qwen2-VL's M-RoPE sections (`mrope_section` of `rope_parameters` or the legacy
/// `rope_scaling`): the rotated pairs that turn by time, height and width positions, and
/// whether they take turns pair by pair (`mrope_interleaved`, Qwen3-VL's and Qwen3.5's layout)
/// instead of running in order. `None` without them.
pub(super) fn mrope_sections(fields: &Fields) -> Result<Option<([usize; 3], bool)>> {
    let Some(scaling) = fields
        .object("rope_parameters")?
        .or(fields.object("rope_scaling")?)
    else {
        return Ok(None);
    };
    let interleaved = scaling.opt_bool("mrope_interleaved")?.unwrap_or(false);
    let Some(sections) = scaling.get("mrope_section") else {
        return Ok(None);
    };
    let sections: Option<Vec<usize>> = (sections.as_array())
        .map(|a| a.iter().map(|v| v.as_u64().map(|n| n as usize)).collect())
        .unwrap_or(None);
    match sections.as_deref() {
        Some(&[t, h, w]) => Ok(Some(([t, h, w], interleaved))),
        _ => Err(scaling.err("`mrope_section` must be three counts of rotated pairs".into())),
    }
}

/// The scaling named by a `rope_parameters` / `rope_scaling` object (`rope_type` or `type`).
pub fn rope_scaling_from(scaling: &Fields) -> Result<RopeScaling> {
    rope_scaling_in(scaling, None)
}

/// [`rope_scaling_from`] for the object found in `config` (the top-level fields, which
/// LongRoPE also reads: `original_max_position_embeddings`, `max_position_embeddings`).
fn rope_scaling_in(scaling: &Fields, config: Option<&Fields>) -> Result<RopeScaling> {
    let kind = match scaling.opt_str("rope_type")? {
        Some(kind) => Some(kind),
        None => scaling.opt_str("type")?,
    };
    let factor = || {
        scaling
            .opt_f64("factor")?
            .ok_or_else(|| scaling.err("rope scaling needs `factor`".into()))
    };
    let scaling = match kind.unwrap_or("default") {
        // Qwen2-VL's legacy name for plain RoPE with `mrope_section` ([`mrope_sections`]).
        "default" | "mrope" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "llama3" => RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: scaling.opt_f64("low_freq_factor")?.unwrap_or(1.0),
            high_freq_factor: scaling.opt_f64("high_freq_factor")?.unwrap_or(4.0),
            original_max_position_embeddings: scaling.usize("original_max_position_embeddings")?,
        },
        // Phi-3's first 128K checkpoints call it `su`.
        "longrope" | "su" => long_rope(scaling, config)?,
        "yarn" => yarn(scaling, config)?,
        "proportional" => RopeScaling::Proportional {
            factor: scaling.opt_f64("factor")?.unwrap_or(1.0),
            partial_rotary_factor: scaling.opt_f64("partial_rotary_factor")?.unwrap_or(1.0),
        },
        other => return Err(scaling.err(format!("unsupported rope scaling type `{other}`"))),
    };
    Ok(scaling)
}

/// LongRoPE's default attention factor for a context `factor` times the `original` one:
/// `sqrt(1 + ln(factor) / ln(original))`, 1 when `factor <= 1` (transformers and llama.cpp's
/// converter alike).
pub fn longrope_attention_factor(factor: f64, original: usize) -> f64 {
    match factor <= 1.0 {
        true => 1.0,
        false => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
    }
}

/// YaRN's `get_mscale`: `0.1 · mscale · ln(factor) + 1` (1 when `factor <= 1`).
pub fn yarn_get_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 {
        return 1.0;
    }
    0.1 * mscale * factor.ln() + 1.0
}

/// YaRN as transformers' `_compute_yarn_parameters` reads it: `factor` (default
/// `max_position_embeddings / original_max_position_embeddings`), `original_max_position_embeddings`
/// (the top level's first, then the scaling object's, then `max_position_embeddings`),
/// `beta_fast` 32, `beta_slow` 1, `truncate` true, and `attention_factor` (default
/// `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)` when both are set and
/// non-zero, else `get_mscale(factor)`).
fn yarn(scaling: &Fields, config: Option<&Fields>) -> Result<RopeScaling> {
    let top = |key: &str| config.map_or(Ok(None), |c| c.opt_usize(key));
    let original = match top("original_max_position_embeddings")? {
        Some(n) => n,
        None => match scaling.opt_usize("original_max_position_embeddings")? {
            Some(n) => n,
            None => top("max_position_embeddings")?.ok_or_else(|| {
                scaling.err("yarn scaling needs `original_max_position_embeddings`".into())
            })?,
        },
    };
    let factor = match scaling.opt_f64("factor")? {
        Some(f) => f,
        None => match top("max_position_embeddings")? {
            Some(max) => max as f64 / original as f64,
            None => return Err(scaling.err("yarn scaling needs `factor`".into())),
        },
    };
    let nonzero =
        |key: &str| -> Result<Option<f64>> { Ok(scaling.opt_f64(key)?.filter(|v| *v != 0.0)) };
    let attention_factor = match scaling.opt_f64("attention_factor")? {
        Some(a) => a,
        None => match (nonzero("mscale")?, nonzero("mscale_all_dim")?) {
            (Some(m), Some(all)) => yarn_get_mscale(factor, m) / yarn_get_mscale(factor, all),
            _ => yarn_get_mscale(factor, 1.0),
        },
    };
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast: nonzero("beta_fast")?.unwrap_or(32.0),
        beta_slow: nonzero("beta_slow")?.unwrap_or(1.0),
        attention_factor,
        truncate: scaling.opt_bool("truncate")?.unwrap_or(true),
    })
}

/// LongRoPE as transformers' `_compute_longrope_parameters` reads it: the factor lists;
/// `original_max_position_embeddings` from the top level of the config when it is there (which
/// transformers prefers), else from the scaling object; `factor` (default
/// `max_position_embeddings / original_max_position_embeddings`) and `attention_factor` (default
/// `sqrt(1 + ln(factor) / ln(original))`, 1 when `factor <= 1`).
fn long_rope(scaling: &Fields, config: Option<&Fields>) -> Result<RopeScaling> {
    let top = |key: &str| config.map_or(Ok(None), |c| c.opt_usize(key));
    let original = match top("original_max_position_embeddings")? {
        Some(n) => n,
        None => scaling.usize("original_max_position_embeddings")?,
    };
    let factor = match scaling.opt_f64("factor")? {
        Some(f) => f,
        None => match top("max_position_embeddings")? {
            Some(max) => max as f64 / original as f64,
            None => return Err(scaling.err("longrope scaling needs `factor`".into())),
        },
    };
    let attention_factor = match scaling.opt_f64("attention_factor")? {
        Some(a) => a,
        None => longrope_attention_factor(factor, original),
    };
    let list = |key: &str| -> Result<Vec<f64>> {
        let v = scaling.f64_list(key)?;
        match v.is_empty() {
            true => Err(scaling.err(format!("longrope scaling needs `{key}`"))),
            false => Ok(v),
        }
    };
    Ok(RopeScaling::LongRope {
        short_factor: list("short_factor")?,
        long_factor: list("long_factor")?,
        original_max_position_embeddings: original,
        attention_factor,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{BASE, parse};

    #[test]
    fn legacy_and_transformers5_rope_keys_agree() {
        let legacy = parse(&format!(
            r#"{{{BASE}, "rope_theta": 5e5, "rope_scaling": {{"type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}}}"#
        ))
        .unwrap();
        let v5 = parse(&format!(
            r#"{{{BASE}, "rope_parameters": {{"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}}}"#
        ))
        .unwrap();
        assert_eq!(legacy.rope_theta, 5e5);
        assert_eq!(legacy, v5);
        assert!(matches!(
            legacy.rope_scaling,
            RopeScaling::Llama3 { factor: 8.0, .. }
        ));
    }

    /// Phi-3.5-mini's layout (legacy `rope_scaling`, `original_max_position_embeddings` and
    /// `max_position_embeddings` at the top level) and transformers 5's `rope_parameters` read
    /// alike; the attention factor defaults to `sqrt(1 + ln(131072/4096) / ln(4096))`.
    #[test]
    fn longrope_reads_legacy_and_transformers5_keys() {
        let base = r#""model_type": "phi3", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 131072"#;
        let factors =
            r#""short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 3.0, 4.0, 5.0]"#;
        let legacy = parse(&format!(
            r#"{{{base}, "original_max_position_embeddings": 4096, "rope_theta": 1e4,
            "rope_scaling": {{"type": "longrope", {factors}}}}}"#
        ))
        .unwrap();
        let su = parse(&format!(
            r#"{{{base}, "original_max_position_embeddings": 4096,
            "rope_scaling": {{"type": "su", {factors}}}}}"#
        ))
        .unwrap();
        let v5 = parse(&format!(
            r#"{{{base}, "rope_parameters": {{"rope_type": "longrope", "rope_theta": 1e4,
            "original_max_position_embeddings": 4096, {factors}}}}}"#
        ))
        .unwrap();
        assert_eq!(legacy, v5);
        assert_eq!(legacy, su);
        let RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        } = &legacy.rope_scaling
        else {
            panic!("{:?}", legacy.rope_scaling)
        };
        assert_eq!(short_factor, &[1.0, 1.1, 1.2, 1.3]);
        assert_eq!(long_factor, &[2.0, 3.0, 4.0, 5.0]);
        assert_eq!(*original_max_position_embeddings, 4096);
        assert!((attention_factor - 1.190_238_071_423_808_3).abs() < 1e-12);
        // The top level's `original_max_position_embeddings` wins, as in transformers; an
        // explicit `attention_factor` (or `factor`) is used as given.
        let given = parse(&format!(
            r#"{{{base}, "original_max_position_embeddings": 64,
            "rope_scaling": {{"type": "longrope", "original_max_position_embeddings": 4096,
            "attention_factor": 1.5, {factors}}}}}"#
        ))
        .unwrap();
        assert!(matches!(
            given.rope_scaling,
            RopeScaling::LongRope {
                original_max_position_embeddings: 64,
                attention_factor: 1.5,
                ..
            }
        ));
        let by_factor = parse(&format!(
            r#"{{{base}, "original_max_position_embeddings": 4096,
            "rope_scaling": {{"type": "longrope", "factor": 1.0, {factors}}}}}"#
        ))
        .unwrap();
        assert!(matches!(
            by_factor.rope_scaling,
            RopeScaling::LongRope {
                attention_factor: 1.0,
                ..
            }
        ));
    }

    /// `partial_rotary_factor` from `rope_parameters` or the top level (transformers moves the
    /// top-level one in unless `rope_parameters` has its own); LongRoPE's factor lists must
    /// cover the rotated pairs.
    #[test]
    fn partial_rotary_factor_and_longrope_lengths() {
        let base = r#""model_type": "phi3", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "original_max_position_embeddings": 8"#;
        let top = parse(&format!(r#"{{{base}, "partial_rotary_factor": 0.75}}"#)).unwrap();
        assert_eq!((top.head_dim, top.rotary_dim()), (16, 12));
        let inner = parse(&format!(
            r#"{{{base}, "partial_rotary_factor": 0.75,
            "rope_parameters": {{"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}}}"#
        ))
        .unwrap();
        assert_eq!(inner.rotary_dim(), 8);
        let long = |n: usize| {
            let f = vec!["1.0"; n].join(", ");
            parse(&format!(
                r#"{{{base}, "partial_rotary_factor": 0.5, "rope_scaling": {{"type": "longrope",
                "factor": 2.0, "short_factor": [{f}], "long_factor": [{f}]}}}}"#
            ))
        };
        assert!(long(4).is_ok());
        let err = long(8).unwrap_err().to_string();
        assert!(
            err.contains("short_factor") && err.contains("need 4"),
            "{err}"
        );
        let err = parse(&format!(r#"{{{base}, "partial_rotary_factor": 0.1}}"#))
            .unwrap_err()
            .to_string();
        assert!(err.contains("partial_rotary_factor"), "{err}");
    }

    /// YaRN as DeepSeek-V3 writes it (the fixture's values): transformers' inverse frequencies
    /// (`_compute_yarn_parameters`, printed from transformers 5.24) and attention factor.
    #[test]
    fn yarn_parses_and_matches_transformers_frequencies() {
        let c = parse(
            r#"{"model_type": "deepseek_v3", "vocab_size": 10, "hidden_size": 64,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 4, "head_dim": 16,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0}}"#,
        )
        .unwrap();
        let RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            attention_factor,
            truncate,
            ..
        } = c.rope_scaling
        else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!(
            (factor, original_max_position_embeddings, truncate),
            (4.0, 64, true)
        );
        assert_eq!(attention_factor, 1.0);
        let want = [
            1.0,
            0.237_170_815,
            0.049_999_997,
            0.007_905_694_7,
            0.002_499_999_9,
            7.905_694_7e-4,
            2.500_000_1e-4,
            7.905_694_7e-5,
        ];
        let got = peregrine_tensor::rope::inv_freqs(16, 1e4, &c.rope_scaling);
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() / w < 1e-6, "{got:?}");
        }
        // Without mscale / mscale_all_dim: attention factor `0.1 ln(factor) + 1`.
        let plain = parse(
            r#"{"model_type": "qwen2", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 256,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}"#,
        )
        .unwrap();
        let RopeScaling::Yarn {
            attention_factor, ..
        } = plain.rope_scaling
        else {
            panic!()
        };
        assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
    }
}
