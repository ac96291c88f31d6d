//! Element-wise fusion: groups of two or more element-wise nodes (unary, backward-of-unary,
//! tensor-scalar and broadcasting binary ops, casts) on one device become one node running a
//! generated kernel (`oxiflow_tensor::custom::FusedElementwise`: a fused loop on the CPU, CUDA C
//! compiled by NVRTC on a GPU), computing exactly what the ops did.
//!
//! A group runs where its root (the last member in the captured order) ran and writes the
//! root's value. Growing backward from a root, the producer of a value a member reads joins
//! when the value is a float piece of the producer's own buffer that no view aliases, the
//! producer is on the root's device, and between the producer and the root no node
//! communicates and no node writes into the buffer of anything the producer reads (moving its
//! work to the root must not change what it reads). The value is then an intermediate when
//! only members read it (no buffer: values of removed nodes stay in the table, unreferenced,
//! and liveness gives them none), or, when it has the root's shape and every other reader comes
//! after the root (or the step returns it), an extra output the group's node writes (at most
//! `MAX_FUSED_OUTPUTS` in all). A boxing that only relabels (no communication, every rank
//! keeps its piece as it is) joins on the same terms as an intermediate: the group reads
//! through it, and it goes with the group.

use std::sync::Arc;

use oxiflow_boxing::StepKind;
use oxiflow_tensor::custom::{
    FusedElementwise, FusedInstr, FusedProgram, FusedStep, MAX_FUSED_INPUTS, MAX_FUSED_OUTPUTS,
    MAX_FUSED_STEPS,
};
use oxiflow_tensor::{Device, Op, OutSpec};

use crate::ir::{Node, NodeKind, OpNode, Origin, Program, ValueId};

/// Most dims of a fused group's output (the generated kernel's strided reads handle this many).
const MAX_DIMS: usize = 8;

/// One generated kernel: a program and the groups that run it.
#[derive(Clone, Debug)]
pub struct FusedKernel {
    pub program: Arc<FusedProgram>,
    pub device: Device,
    /// Groups of the program that run it.
    pub groups: usize,
}

/// What fusion did.
#[derive(Clone, Debug, Default)]
pub struct FusionStats {
    /// Groups fused (each now one node).
    pub groups: usize,
    /// Element-wise nodes those groups replaced.
    pub ops_fused: usize,
    /// Values of members read outside their group (after it, or returned), which the group's
    /// node writes besides its root's.
    pub escapes: usize,
    /// Relabelling boxings (no communication, every rank keeps its piece) the groups read
    /// through, removed with them.
    pub relabels: usize,
    /// The distinct programs, in order of first use.
    pub kernels: Vec<FusedKernel>,
}

/// The element-wise op of node `i` when it can be a member: one kernel on this rank writing one
/// float value into a buffer of its own.
fn member_op(p: &Program, node: &Node) -> Option<oxiflow_tensor::ElementwiseOp> {
    let NodeKind::Op(o) = &node.kind else {
        return None;
    };
    let Op::Elementwise(e) = &o.local_op else {
        return None;
    };
    let [Some(out)] = node.outputs.as_slice() else {
        return None;
    };
    let v = &p.values[out.index()];
    let float = |id: &ValueId| p.values[id.index()].dtype.is_float();
    let ok = node.runs_kernel()
        && v.alias_of.is_none()
        && float(out)
        && node.inputs.iter().all(float)
        && node
            .inputs
            .iter()
            .all(|i| p.values[i.index()].device == node.device)
        && FusedStep::of(e, &vec![0; node.inputs.len()]).is_some();
    ok.then(|| e.clone())
}

/// Per value: the nodes reading it, whether a step output holds it, the nodes writing values
/// that alias it.
struct Uses {
    readers: Vec<Vec<usize>>,
    returned: Vec<bool>,
    aliases: Vec<Vec<usize>>,
    /// Per buffer (root of an alias chain): the nodes that write a value into it.
    writers: Vec<Vec<usize>>,
    /// Communicating nodes before each node (and before the end).
    comms_before: Vec<usize>,
}

fn uses(p: &Program) -> Uses {
    let n = p.values.len();
    let mut u = Uses {
        readers: vec![Vec::new(); n],
        returned: vec![false; n],
        aliases: vec![Vec::new(); n],
        writers: vec![Vec::new(); n],
        comms_before: Vec::with_capacity(p.nodes.len() + 1),
    };
    let mut comms = 0;
    for node in &p.nodes {
        u.comms_before.push(comms);
        comms += usize::from(node.communicates());
    }
    u.comms_before.push(comms);
    for (i, node) in p.nodes.iter().enumerate() {
        for v in &node.inputs {
            u.readers[v.index()].push(i);
        }
        for v in node.outputs.iter().flatten() {
            u.writers[p.buffer_of(*v).index()].push(i);
        }
    }
    for v in p.output_values() {
        u.returned[v.index()] = true;
    }
    for v in &p.values {
        if let (Some(a), Some(w)) = (v.alias_of, producer_of(p, &v.origin)) {
            u.aliases[a.index()].push(w);
        }
    }
    u
}

/// The node of `origin` when it is a node of the program.
fn producer_of(p: &Program, origin: &Origin) -> Option<usize> {
    match *origin {
        Origin::Node { node, .. } if node < p.nodes.len() => Some(node),
        _ => None,
    }
}

/// The producer of `v` when it is a node of the program.
fn producer(p: &Program, v: ValueId) -> Option<usize> {
    producer_of(p, &p.values[v.index()].origin)
}

/// The input of `node` when it is a boxing that only relabels (every rank keeps its piece, no
/// communication) and its output is that piece under the same shape and dtype: a group reads
/// through it as through nothing.
fn relabel_of(p: &Program, node: &Node) -> Option<ValueId> {
    let NodeKind::Boxing { plan, .. } = &node.kind else {
        return None;
    };
    let relabels = plan
        .steps
        .iter()
        .all(|s| matches!(s.kind, StepKind::Relabel));
    let ([u], [Some(v)]) = (node.inputs.as_slice(), node.outputs.as_slice()) else {
        return None;
    };
    let (a, b) = (&p.values[u.index()], &p.values[v.index()]);
    let same = b.alias_of == Some(*u)
        && a.shape == b.shape
        && a.dtype == b.dtype
        && a.device == node.device
        && b.device == node.device;
    (relabels && same).then_some(*u)
}

/// A group: its members in captured order (the root last; relabelling boxings it reads through
/// among them) and the members' values read outside it (after the root, or returned), which it
/// writes besides the root's.
struct Group {
    members: Vec<usize>,
    escapes: Vec<ValueId>,
}

/// What each node can be in a group: an element-wise op, or a relabel it reads through.
struct Roles {
    op: Vec<bool>,
    relabel: Vec<Option<ValueId>>,
}

/// The group rooted at `root` (see the module docs).
fn grow(p: &Program, u: &Uses, roles: &Roles, taken: &[bool], root: usize) -> Group {
    let device = p.nodes[root].device;
    let shape = p.nodes[root]
        .outputs
        .first()
        .copied()
        .flatten()
        .map(|v| &p.values[v.index()].shape);
    let mut members = vec![root];
    let mut is_member = vec![false; p.nodes.len()];
    is_member[root] = true;
    let mut escaping = 0;
    let mut grew = true;
    while grew && members.len() < MAX_FUSED_STEPS / 2 {
        grew = false;
        let frontier: Vec<ValueId> = members
            .iter()
            .flat_map(|&m| p.nodes[m].inputs.iter().copied())
            .collect();
        for v in frontier {
            let Some(q) = producer(p, v) else { continue };
            let relabel = roles.relabel[q].is_some();
            if is_member[q] || taken[q] || !(roles.op[q] || relabel) || p.nodes[q].device != device
            {
                continue;
            }
            let (i, readers) = (v.index(), &u.readers[v.index()]);
            let inside = !u.returned[i]
                && u.aliases[i].iter().all(|&w| is_member[w])
                && readers.iter().all(|&r| is_member[r]);
            // Read outside only after the root (or returned): the group writes it too.
            let escapes = !inside
                && !relabel
                && u.aliases[i].is_empty()
                && escaping + 1 < MAX_FUSED_OUTPUTS
                && Some(&p.values[i].shape) == shape
                && readers.iter().all(|&r| is_member[r] || r > root);
            let clear = u.comms_before[root] == u.comms_before[q + 1]
                && p.nodes[q].inputs.iter().all(|x| {
                    u.writers[p.buffer_of(*x).index()]
                        .iter()
                        .all(|&w| w <= q || w >= root)
                });
            if (inside || escapes) && clear {
                escaping += usize::from(escapes);
                is_member[q] = true;
                members.push(q);
                grew = true;
            }
        }
    }
    members.sort_unstable();
    let escapes = members[..members.len() - 1]
        .iter()
        .filter(|&&m| roles.op[m])
        .filter_map(|&m| p.nodes[m].outputs.first().copied().flatten())
        .filter(|v| u.returned[v.index()] || u.readers[v.index()].iter().any(|&r| !is_member[r]))
        .collect();
    Group { members, escapes }
}

/// The program of a group (its outputs the root's value, then the escapes) and its external
/// inputs, in input order; None when it does not fit a fused kernel.
fn program_of(p: &Program, g: &Group) -> Option<(FusedProgram, Vec<ValueId>)> {
    let members = &g.members;
    let mut instrs: Vec<FusedInstr> = Vec::new();
    let mut step_of: Vec<(ValueId, usize)> = Vec::new();
    let mut inputs: Vec<ValueId> = Vec::new();
    for &m in members {
        let node = &p.nodes[m];
        if let Some(src) = relabel_of(p, node) {
            // Its output is its input's piece: the same step.
            let out = node.outputs.first().copied().flatten()?;
            let at = match step_of.iter().find(|(w, _)| *w == src) {
                Some(&(_, s)) => s,
                None => {
                    instrs.push(FusedInstr {
                        step: FusedStep::Input(inputs.len()),
                        dtype: p.values[src.index()].dtype,
                    });
                    inputs.push(src);
                    instrs.len() - 1
                }
            };
            step_of.push((src, at));
            step_of.push((out, at));
            continue;
        }
        let NodeKind::Op(o) = &node.kind else {
            return None;
        };
        let Op::Elementwise(e) = &o.local_op else {
            return None;
        };
        let mut args = Vec::with_capacity(node.inputs.len());
        for v in &node.inputs {
            let at = match step_of.iter().find(|(w, _)| w == v) {
                Some(&(_, s)) => s,
                None => {
                    instrs.push(FusedInstr {
                        step: FusedStep::Input(inputs.len()),
                        dtype: p.values[v.index()].dtype,
                    });
                    inputs.push(*v);
                    step_of.push((*v, instrs.len() - 1));
                    instrs.len() - 1
                }
            };
            args.push(at);
        }
        let out = node.outputs.first().copied().flatten()?;
        instrs.push(FusedInstr {
            step: FusedStep::of(e, &args)?,
            dtype: p.values[out.index()].dtype,
        });
        step_of.push((out, instrs.len() - 1));
    }
    if inputs.len() > MAX_FUSED_INPUTS {
        return None;
    }
    let more: Vec<usize> = g
        .escapes
        .iter()
        .map(|v| step_of.iter().find(|(w, _)| w == v).map(|&(_, s)| s))
        .collect::<Option<_>>()?;
    FusedProgram::with_outputs(instrs, &more)
        .ok()
        .map(|prog| (prog, inputs))
}

/// Fuses the element-wise groups of `program` (see the module docs).
pub fn fuse_elementwise(program: &mut Program) -> FusionStats {
    let u = uses(program);
    let roles = Roles {
        op: program
            .nodes
            .iter()
            .map(|n| member_op(program, n).is_some())
            .collect(),
        relabel: program
            .nodes
            .iter()
            .map(|n| relabel_of(program, n))
            .collect(),
    };
    let mut taken = vec![false; program.nodes.len()];
    let mut replace: Vec<Option<Node>> = vec![None; program.nodes.len()];
    let mut stats = FusionStats::default();
    // Escaping values, now written by their group's node: (value, root, output).
    let mut moved: Vec<(ValueId, usize, usize)> = Vec::new();
    for root in (0..program.nodes.len()).rev() {
        if !roles.op[root] || taken[root] {
            continue;
        }
        let group = grow(program, &u, &roles, &taken, root);
        let ops = group.members.iter().filter(|&&m| roles.op[m]).count();
        if ops < 2 {
            continue;
        }
        let root_node = &program.nodes[root];
        let out_dims = root_node
            .outputs
            .first()
            .copied()
            .flatten()
            .map_or(usize::MAX, |v| program.values[v.index()].shape.ndim());
        let Some((prog, inputs)) = (out_dims <= MAX_DIMS)
            .then(|| program_of(program, &group))
            .flatten()
        else {
            continue;
        };
        let (NodeKind::Op(_), Some(root_value)) = (
            &root_node.kind,
            root_node.outputs.first().copied().flatten(),
        ) else {
            continue;
        };
        let prog = match stats
            .kernels
            .iter_mut()
            .find(|k| *k.program == prog && k.device == root_node.device)
        {
            Some(k) => {
                k.groups += 1;
                k.program.clone()
            }
            None => {
                let prog = Arc::new(prog);
                stats.kernels.push(FusedKernel {
                    program: prog.clone(),
                    device: root_node.device,
                    groups: 1,
                });
                prog
            }
        };
        let outputs: Vec<ValueId> = std::iter::once(root_value)
            .chain(group.escapes.iter().copied())
            .collect();
        let spec = |v: &ValueId| OutSpec {
            shape: program.values[v.index()].shape.clone(),
            dtype: program.values[v.index()].dtype,
        };
        let op: Op = FusedElementwise { program: prog }.into();
        replace[root] = Some(Node {
            kind: NodeKind::Op(Box::new(OpNode {
                op: op.clone(),
                local_op: op,
                signature: None,
                out_specs: Some(outputs.iter().map(spec).collect()),
                view_of: None,
            })),
            inputs,
            outputs: outputs.iter().copied().map(Some).collect(),
            device: root_node.device,
        });
        moved.extend(
            group
                .escapes
                .iter()
                .enumerate()
                .map(|(k, &v)| (v, root, k + 1)),
        );
        for &m in &group.members {
            taken[m] = true;
        }
        stats.groups += 1;
        stats.ops_fused += ops;
        stats.relabels += group.members.len() - ops;
        stats.escapes += group.escapes.len();
    }
    stats.kernels.reverse();
    for (v, node, output) in moved {
        program.values[v.index()].origin = Origin::Node { node, output };
    }
    rebuild(program, &taken, replace);
    stats
}

/// Keeps the nodes not taken by a group and puts each group's node at its root, renumbering
/// the values' origins (removed nodes' values point past the end).
fn rebuild(program: &mut Program, taken: &[bool], mut replace: Vec<Option<Node>>) {
    let mut new_index = vec![None; program.nodes.len()];
    let mut kept = Vec::with_capacity(program.nodes.len());
    for (i, node) in std::mem::take(&mut program.nodes).into_iter().enumerate() {
        let node = match replace[i].take() {
            Some(fused) => fused,
            None if taken[i] => continue,
            None => node,
        };
        new_index[i] = Some(kept.len());
        kept.push(node);
    }
    program.nodes = kept;
    for v in &mut program.values {
        if let Origin::Node { node, .. } = &mut v.origin {
            *node = new_index
                .get(*node)
                .copied()
                .flatten()
                .unwrap_or(usize::MAX);
        }
    }
}

/// Generates and compiles the device kernels of the program's fused nodes ahead of the first
/// replay (on several threads; groups of one program and broadcast pattern share a kernel).
/// Returns the number of distinct device kernels (0 on the CPU, whose fused loop needs none).
pub fn prebuild_kernels(program: &Program) -> oxiflow_tensor::Result<usize> {
    let mut calls = Vec::new();
    for node in &program.nodes {
        let NodeKind::Op(o) = &node.kind else {
            continue;
        };
        let Op::Custom(oxiflow_tensor::custom::CustomOp::FusedElementwise(f)) = &o.local_op else {
            continue;
        };
        let (Device::Cuda(_), Some(Some(out))) = (node.device, node.outputs.first()) else {
            continue;
        };
        let dims = |v: &ValueId| program.values[v.index()].shape.dims().to_vec();
        calls.push(oxiflow_cuda::FusedCall {
            program: &f.program,
            inputs: node.inputs.iter().map(dims).collect(),
            out: dims(out),
        });
    }
    if calls.is_empty() {
        return Ok(0);
    }
    oxiflow_cuda::prebuild_fused_elementwise(&calls)
}
