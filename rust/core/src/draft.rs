//! The n-gram drafter (prompt lookup, vLLM's `ngram` speculative method): proposes the tokens
//! that followed the most recent earlier occurrence of the sequence's last n tokens.
//!
//! No model: it costs a scan of the request's tokens and gives real acceptance on repetitive
//! text (code edits re-emitting the prompt, quoted documents). The engine verifies every draft
//! (a verify row of 1 + k tokens, one sample per position) and commits the longest prefix the
//! target model agreed with plus its next token, so the drafter can never change the output.

/// Up to `max_tokens` drafts for `tokens`: for `n` from `max_n` down to `min_n`, the tokens that
/// followed the most recent earlier occurrence of the last `n` tokens (the occurrence may
/// overlap the suffix, as in a repeated pattern); empty when nothing matches.
pub fn propose_ngram(tokens: &[u32], min_n: usize, max_n: usize, max_tokens: usize) -> Vec<u32> {
    let len = tokens.len();
    if max_tokens == 0 || min_n == 0 || len < min_n + 1 {
        return Vec::new();
    }
    for n in (min_n..=max_n.min(len - 1)).rev() {
        let suffix = &tokens[len - n..];
        // Most recent start `s < len - n` with tokens[s..s+n] == suffix.
        if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
            let from = start + n;
            let to = (from + max_tokens).min(len);
            return tokens[from..to].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_last_occurrence() {
        // ... 1 2 3 | 9 ... 1 2 3 -> 9 and what followed it.
        let t = [1, 2, 3, 9, 8, 5, 1, 2, 3];
        assert_eq!(propose_ngram(&t, 1, 3, 2), vec![9, 8]);
        assert_eq!(propose_ngram(&t, 1, 3, 10), vec![9, 8, 5, 1, 2, 3]);
        // The longest n first: a 1-gram match elsewhere does not win over the 3-gram.
        let t = [3, 7, 1, 2, 3, 9, 1, 2, 3];
        assert_eq!(propose_ngram(&t, 1, 3, 1), vec![9]);
        // A repeated token: the occurrence overlaps the suffix.
        assert_eq!(propose_ngram(&[5, 5, 5], 1, 2, 3), vec![5]);
        // No match, or nothing asked for.
        assert!(propose_ngram(&[1, 2, 3, 4], 1, 3, 4).is_empty());
        assert!(propose_ngram(&[1, 2, 1, 2], 1, 3, 0).is_empty());
        assert!(propose_ngram(&[1], 1, 3, 4).is_empty());
    }
}
