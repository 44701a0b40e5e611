//! One decode step, alone: `cargo bench -p peregrine --bench decode_step [-- MODEL [CONTEXT [STEPS]]]`.
//! Loads MODEL (a GGUF file or checkpoint folder; default the tiny llama fixture, whose figures
//! only show that the step runs), prefills CONTEXT tokens (default 512) into an f16 KV cache as
//! the server stores it, then times STEPS (default 64) calls of `CausalLm::decode`, the step the
//! engine runs per generated token. With `DECODE_BATCH=B` (B > 1) it prefills B sequences and
//! times `CausalLm::forward_batch` advancing all B by a token, as the scheduler's step does
//! with B streams decoding (`DECODE_VIA_BATCH=1` times one sequence through that path too, to
//! compare it with the allocation-free step). Prints one JSON line: median and p90 milliseconds per step and the
//! median's tokens per second (all sequences'), over the threads rayon uses
//! (`RAYON_NUM_THREADS`).

use std::path::PathBuf;
use std::time::Instant;

use peregrine::models::{BatchSeq, KvOptions, LoadOptions, Logits, SequenceCache, load_model};
use peregrine::tensor::DType;
use peregrine::tensor::device::in_compute_pool;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // `cargo bench` passes `--bench`; positional arguments are ours.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let model_path = args.first().map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llama/hf")
    });
    let context: usize = args.get(1).map_or(Ok(512), |a| a.parse())?;
    let steps: usize = args.get(2).map_or(Ok(64), |a| a.parse())?;
    let options = LoadOptions {
        max_context: Some(context + steps + 1),
        ..LoadOptions::default()
    };
    let model = load_model(&model_path, &options)?.model;
    let vocab = model.config().vocab_size as u32;
    let kv = KvOptions {
        dtype: Some(DType::F16),
        ..KvOptions::default()
    };
    let batch: usize = std::env::var("DECODE_BATCH").map_or(Ok(1), |b| b.parse())?;
    let mut caches: Vec<SequenceCache> = (0..batch)
        .map(|_| SequenceCache::new(&model.cache_spec(), &kv))
        .collect();
    // Prompts of ids spread over the vocabulary; the step's cost does not depend on which.
    for (b, cache) in caches.iter_mut().enumerate() {
        let prompt: Vec<u32> = (0..context as u32)
            .map(|i| (i * 7919 + 13 + b as u32) % vocab)
            .collect();
        in_compute_pool(|| model.forward(&prompt, cache, Logits::Last))?;
    }
    let mut logits = Vec::new();
    let mut times = Vec::with_capacity(steps);
    let mut tokens = vec![1u32; batch];
    for _ in 0..steps {
        let start = Instant::now();
        if batch == 1 && std::env::var("DECODE_VIA_BATCH").is_err() {
            in_compute_pool(|| model.decode(tokens[0], &mut caches[0], &mut logits))?;
            tokens[0] = peregrine::sampling::argmax(&logits);
        } else {
            let rows = in_compute_pool(|| {
                let fed: Vec<[u32; 1]> = tokens.iter().map(|&t| [t]).collect();
                let mut seqs: Vec<BatchSeq> = (fed.iter().zip(caches.iter_mut()))
                    .map(|(t, c)| BatchSeq::last(t, c))
                    .collect();
                model
                    .forward_batch(&mut seqs)?
                    .to_vec2::<f32>()
                    .map_err(Into::into)
            });
            let rows: Vec<Vec<f32>> = rows.map_err(|e: peregrine::models::ModelError| e)?;
            for (t, row) in tokens.iter_mut().zip(&rows) {
                *t = peregrine::sampling::argmax(row);
            }
        }
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let p90 = times[(times.len() * 9 / 10).min(times.len() - 1)];
    println!(
        "{{\"bench\":\"decode_step\",\"model\":{:?},\"context\":{context},\"steps\":{steps},\
         \"batch\":{batch},\"threads\":{},\"ms_median\":{median:.3},\"ms_p90\":{p90:.3},\"tok_per_s\":{:.1}}}",
        model_path.display().to_string(),
        rayon::current_num_threads(),
        batch as f64 * 1e3 / median
    );
    Ok(())
}
