//! The models `train` runs, with their data: the GPT (`gpt`, `gpt_data`) and the MLP classifier
//! (`mlp`), and the job's mesh of stages (`mesh`).

pub mod gpt;
pub mod gpt_data;
pub mod mesh;
pub mod mlp;
