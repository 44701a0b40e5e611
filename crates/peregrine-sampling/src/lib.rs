//! Logits processors and seeded sampling (in progress)
