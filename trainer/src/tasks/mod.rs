//! The models `train` runs, with their data: the decoder (`decoder`: GPT, Llama or a Hugging
//! Face model; `gpt`, `gpt_data`; its evaluation, `eval`; `generate`) and the MLP classifier (`mlp`), and
//! the job's mesh of stages (`mesh`).

pub mod decoder;
pub mod eval;
pub mod generate;
pub mod gpt;
pub mod gpt_data;
pub mod mesh;
pub mod mlp;
