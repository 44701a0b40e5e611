//! One decode step, alone: `cargo bench -p peregrine --bench decode_step [-- MODEL [CONTEXT [STEPS]]]`.
//! Loads MODEL (a GGUF file or checkpoint folder; default the tiny llama fixture, whose figures
//! only show that the step runs), prefills CONTEXT tokens (default 512) into an f16 KV cache as
//! the server stores it, then times STEPS (default 64) calls of `CausalLm::decode`, the step the
//! engine runs per generated token. Prints one JSON line: median and p90 milliseconds per step
//! and the median's tokens per second, over the threads rayon uses (`RAYON_NUM_THREADS`).

use std::path::PathBuf;
use std::time::Instant;

use peregrine::models::{KvOptions, LoadOptions, Logits, SequenceCache, load_model};
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
    let mut cache = SequenceCache::new(&model.cache_spec(), &kv);
    // A prompt of ids spread over the vocabulary; the step's cost does not depend on which.
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    in_compute_pool(|| model.forward(&prompt, &mut cache, Logits::Last))?;
    let mut logits = Vec::new();
    let mut times = Vec::with_capacity(steps);
    let mut token = 1;
    for _ in 0..steps {
        let start = Instant::now();
        in_compute_pool(|| model.decode(token, &mut cache, &mut logits))?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
        token = peregrine::sampling::argmax(&logits);
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let p90 = times[(times.len() * 9 / 10).min(times.len() - 1)];
    println!(
        "{{\"bench\":\"decode_step\",\"model\":{:?},\"context\":{context},\"steps\":{steps},\
         \"threads\":{},\"ms_median\":{median:.3},\"ms_p90\":{p90:.3},\"tok_per_s\":{:.1}}}",
        model_path.display().to_string(),
        rayon::current_num_threads(),
        1e3 / median
    );
    Ok(())
}
