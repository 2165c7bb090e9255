//! Greedy generation: feed a prompt, then always take the most likely next token.
//!
//! The loop is llama2.c `run.c`'s: `steps` forward passes at positions `0..steps`. While the prompt
//! lasts, its next token is fed (teacher forcing; one [`Forward::prefill`], bit for bit the same as
//! feeding them one by one); after that the argmax of the logits is generated and fed back. Generation ends after `steps` positions, or as soon as the model emits one of the
//! stop tokens, which is neither kept nor fed. Which tokens stop is the vocabulary's convention
//! ([`crate::Tokenizer::stop_tokens`]): BOS for llama2.c models, as `run.c` does; `<|im_end|>` and
//! `<|endoftext|>` for SmolLM2.

use crate::error::InferError;
use crate::forward::Forward;
use crate::kv_cache::KvCache;
use crate::model::Model;

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// All `steps` positions were run.
    Steps,
    /// The model emitted this stop token.
    Token(u32),
}

/// The outcome of [`generate_greedy`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generation {
    /// The token fed at each position, in order: the prompt, then generated tokens. Its length is
    /// the number of forward passes run, and the number of tokens in the cache.
    pub fed: Vec<u32>,
    /// The tokens chosen after the prompt ended (the last one is not fed when `steps` ran out).
    pub generated: Vec<u32>,
    /// Why generation ended.
    pub stop: Stop,
}

/// The index of the largest logit; the lowest index wins ties, as in run.c.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Runs `prompt` and then greedy decoding for `steps` positions in total, against an empty
/// `cache`, stopping early when the model emits a token in `stop`.
pub fn generate_greedy<C: KvCache + ?Sized>(
    model: &Model,
    cache: &mut C,
    prompt: &[u32],
    steps: usize,
    stop: &[u32],
) -> Result<Generation, InferError> {
    if prompt.is_empty() {
        return Err(InferError::InvalidArgument("the prompt is empty; start from at least one token (BOS)".to_owned()));
    }
    let seq_len = model.config().seq_len;
    if steps > seq_len {
        return Err(InferError::InvalidArgument(format!(
            "{steps} steps would run past the model's context of {seq_len} tokens (seq_len)"
        )));
    }
    let mut forward = Forward::new(model);
    let mut out = Generation { fed: Vec::with_capacity(steps), generated: Vec::new(), stop: Stop::Steps };
    // The prompt's tokens (as many as the steps allow) in one prefill: the logits after the last
    // are bit for bit those of feeding them one by one.
    let forced = prompt.len().min(steps);
    if forced == 0 {
        return Ok(out);
    }
    let mut logits = forward.prefill(model, cache, &prompt[..forced], 0)?;
    out.fed.extend_from_slice(&prompt[..forced]);
    if forced < prompt.len() {
        return Ok(out);
    }
    for pos in forced..=steps {
        let chosen = argmax(logits);
        if stop.contains(&chosen) {
            out.stop = Stop::Token(chosen);
            break;
        }
        out.generated.push(chosen);
        if pos == steps {
            break;
        }
        logits = forward.step(model, cache, chosen, pos)?;
        out.fed.push(chosen);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_picks_the_first_of_equal_maxima() {
        assert_eq!(argmax(&[0.0, 3.0, -1.0, 3.0]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY]), 0);
    }
}
