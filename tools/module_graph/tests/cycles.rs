//! The workspace's module cycles (files that import each other in a loop), printed, and held to
//! a budget that only goes down.

use oxiflow_module_graph::{workspace_graphs, workspace_root};

/// Most module cycles the workspace may have.
const MAX_CYCLES: usize = 1;

#[test]
fn module_cycles_stay_within_the_budget() {
    let root = workspace_root();
    let graphs = workspace_graphs(&root).expect("reading the workspace's sources");
    assert!(
        graphs.iter().map(|g| g.files()).sum::<usize>() > 100,
        "the workspace's files were not found from {}",
        root.display()
    );
    let mut all = Vec::new();
    for g in &graphs {
        let base = root.join(g.name.split(' ').next().unwrap_or("."));
        for c in g.cycles(&base) {
            println!("{}: {} files: {}", g.name, c.len(), c.join(" "));
            all.push((g.name.clone(), c));
        }
    }
    let ops: Vec<_> = all.iter().filter(|(name, _)| name == "ops").collect();
    assert!(ops.is_empty(), "the ops crate has module cycles: {ops:?}");
    assert!(
        all.len() <= MAX_CYCLES,
        "{} module cycles, at most {MAX_CYCLES} allowed: {all:?}",
        all.len()
    );
}
