//! The workspace's module cycles (files that import each other in a loop), printed: there are
//! none, and none may come.

use oxiflow_module_graph::{workspace_graphs, workspace_root};

#[test]
fn the_workspace_has_no_module_cycles() {
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
    assert!(all.is_empty(), "{} module cycles: {all:?}", all.len());
}
