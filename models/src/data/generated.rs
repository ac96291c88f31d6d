//! Generated text with learnable structure, for machines without a text corpus: sentences
//! from a seeded vocabulary of made-up words, with word order from a seeded Markov chain.

use oxiflow_tensor::rng::uniform;

const WORDS: usize = 64;
const SUCCESSORS: usize = 4;
const LETTERS: &[u8] = b"etaoinshrdlucmfwyp";

/// About `len` bytes of text drawn from `seed`: the same seed gives the same text.
pub fn generated_text(seed: u64, len: usize) -> String {
    let mut draw = 0u64;
    let mut next = |n: usize| -> usize {
        draw += 1;
        ((uniform(seed, draw) * n as f64) as usize).min(n.saturating_sub(1))
    };
    let words: Vec<String> = (0..WORDS)
        .map(|_| {
            let n = 2 + next(6);
            (0..n)
                .map(|_| char::from(LETTERS[next(LETTERS.len())]))
                .collect()
        })
        .collect();
    let successors: Vec<[usize; SUCCESSORS]> = (0..WORDS)
        .map(|_| std::array::from_fn(|_| next(WORDS)))
        .collect();
    let mut text = String::with_capacity(len + 16);
    let mut w = 0;
    let mut in_sentence = 0;
    while text.len() < len {
        let word = &words[w];
        if in_sentence == 0 {
            let mut c = word.chars();
            if let Some(first) = c.next() {
                text.extend(first.to_uppercase());
                text.push_str(c.as_str());
            }
        } else {
            text.push_str(word);
        }
        in_sentence += 1;
        if in_sentence > 4 && next(4) == 0 {
            text.push_str(".\n");
            in_sentence = 0;
        } else {
            text.push(' ');
        }
        w = successors[w][next(SUCCESSORS)];
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seed_decides_the_text() {
        assert_eq!(generated_text(3, 500), generated_text(3, 500));
        assert_ne!(generated_text(3, 500), generated_text(4, 500));
        assert!(generated_text(3, 500).len() >= 500);
    }
}
