//! The launcher families whose variables give rank, world size and the local layout
//! (torchrun/oflaunch, Open MPI, MPICH/PMI, Slurm), how one family is read (`read_family`,
//! Slurm's task lists included), and the variable lookup that names a variable in its errors.

use crate::CommError;

/// The variable names of one launcher family.
pub(super) struct Family {
    pub(super) name: &'static str,
    pub(super) rank: &'static str,
    pub(super) size: &'static str,
    pub(super) local_rank: &'static str,
    pub(super) local_size: Option<&'static str>,
}

pub(super) const TORCHRUN: Family = Family {
    name: "torchrun",
    rank: "RANK",
    size: "WORLD_SIZE",
    local_rank: "LOCAL_RANK",
    local_size: Some("LOCAL_WORLD_SIZE"),
};
pub(super) const OPEN_MPI: Family = Family {
    name: "Open MPI",
    rank: "OMPI_COMM_WORLD_RANK",
    size: "OMPI_COMM_WORLD_SIZE",
    local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
    local_size: Some("OMPI_COMM_WORLD_LOCAL_SIZE"),
};
pub(super) const PMI: Family = Family {
    name: "MPICH/PMI",
    rank: "PMI_RANK",
    size: "PMI_SIZE",
    local_rank: "MPI_LOCALRANKID",
    local_size: Some("MPI_LOCALNRANKS"),
};
const SLURM: Family = Family {
    name: "Slurm",
    rank: "SLURM_PROCID",
    size: "SLURM_NTASKS",
    local_rank: "SLURM_LOCALID",
    local_size: None,
};
pub(super) const FAMILIES: [&Family; 4] = [&TORCHRUN, &OPEN_MPI, &PMI, &SLURM];

pub(super) fn env_err(msg: String) -> CommError {
    CommError::Env(msg)
}

/// Reads variables through a lookup function, with parsing that names the variable.
pub(super) struct Vars<F: Fn(&str) -> Option<String>> {
    pub(super) get: F,
}

impl<F: Fn(&str) -> Option<String>> Vars<F> {
    pub(super) fn raw(&self, name: &str) -> Option<String> {
        (self.get)(name)
    }

    pub(super) fn usize(&self, name: &str) -> Result<Option<usize>, CommError> {
        match self.raw(name) {
            None => Ok(None),
            Some(v) => v
                .trim()
                .parse::<usize>()
                .map(Some)
                .map_err(|_| env_err(format!("{name}={v:?} is not a non-negative integer"))),
        }
    }

    pub(super) fn required_usize(&self, name: &str, because: &str) -> Result<usize, CommError> {
        self.usize(name)?
            .ok_or_else(|| env_err(format!("{name} is missing ({because})")))
    }
}

/// Rank, size and local layout as one family reports them.
pub(super) struct Reading {
    pub(super) family: &'static Family,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) local: Option<(usize, usize)>,
    pub(super) node_rank: Option<usize>,
    pub(super) local_size_var: String,
}

pub(super) fn read_family<F: Fn(&str) -> Option<String>>(
    vars: &Vars<F>,
    fam: &'static Family,
) -> Result<Option<Reading>, CommError> {
    let has_rank = vars.raw(fam.rank).is_some();
    let has_size = vars.raw(fam.size).is_some();
    if !has_rank && !has_size {
        return Ok(None);
    }
    let rank = vars.required_usize(
        fam.rank,
        &format!(
            "{} is set, a {} launch",
            if has_size { fam.size } else { fam.rank },
            fam.name
        ),
    )?;
    let size = vars.required_usize(
        fam.size,
        &format!("{} is set, a {} launch", fam.rank, fam.name),
    )?;
    let local_rank = vars.usize(fam.local_rank)?;
    let (local_size, local_size_var, node_rank) = match fam.local_size {
        Some(var) => (vars.usize(var)?, var.to_string(), None),
        None => slurm_local_size(vars)?,
    };
    let local = match (local_rank, local_size) {
        (Some(r), Some(s)) => Some((r, s)),
        (None, None) => None,
        (Some(_), None) => {
            return Err(env_err(format!(
                "{local_size_var} is missing ({} is set, a {} launch)",
                fam.local_rank, fam.name
            )))
        }
        (None, Some(_)) => {
            return Err(env_err(format!(
                "{} is missing ({local_size_var} is set, a {} launch)",
                fam.local_rank, fam.name
            )))
        }
    };
    Ok(Some(Reading {
        family: fam,
        rank,
        size,
        local,
        node_rank,
        local_size_var,
    }))
}

/// Slurm's tasks on this node: `SLURM_STEP_TASKS_PER_NODE` (or `SLURM_TASKS_PER_NODE`), a
/// list like `2(x3),1`, at index `SLURM_NODEID`. Returns (local size, the variable, node id).
fn slurm_local_size<F: Fn(&str) -> Option<String>>(
    vars: &Vars<F>,
) -> Result<(Option<usize>, String, Option<usize>), CommError> {
    let node_id = vars.usize("SLURM_NODEID")?;
    let Some((var, list)) = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
        .iter()
        .find_map(|v| vars.raw(v).map(|l| (v.to_string(), l)))
    else {
        return Ok((None, "SLURM_STEP_TASKS_PER_NODE".into(), node_id));
    };
    let per_node = parse_tasks_per_node(&list).ok_or_else(|| {
        env_err(format!(
            "{var}={list:?} is not a Slurm task count list like \"2(x3),1\""
        ))
    })?;
    let local = match node_id {
        Some(id) => Some(*per_node.get(id).ok_or_else(|| {
            env_err(format!(
                "SLURM_NODEID={id} is outside the {} node(s) listed in {var}={list:?}",
                per_node.len()
            ))
        })?),
        // Without a node id only a uniform list tells the local size.
        None if per_node.windows(2).all(|w| w[0] == w[1]) => per_node.first().copied(),
        None => None,
    };
    Ok((local, var, node_id))
}

/// Parses `2(x3),1` into `[2, 2, 2, 1]` (at most 1 << 20 nodes).
fn parse_tasks_per_node(list: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in list.trim().split(',') {
        let (count, repeat) = match part.split_once("(x") {
            Some((c, r)) => (c, r.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (part, 1),
        };
        let count = count.parse::<usize>().ok()?;
        if out.len() + repeat > 1 << 20 {
            return None;
        }
        out.extend(std::iter::repeat_n(count, repeat));
    }
    (!out.is_empty()).then_some(out)
}
