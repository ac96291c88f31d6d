//! Prints every crate's module cycles (files that import each other in a loop), one line per
//! cycle, and their count.

use oxiflow_module_graph::{workspace_graphs, workspace_root};

fn main() -> std::io::Result<()> {
    let root = workspace_root();
    let mut total = 0;
    for g in workspace_graphs(&root)? {
        let base = root.join(g.name.split(' ').next().unwrap_or("."));
        for c in g.cycles(&base) {
            total += 1;
            println!("{}: {} files: {}", g.name, c.len(), c.join(" "));
        }
    }
    println!("{total} module cycles");
    Ok(())
}
