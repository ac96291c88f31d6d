//! Launch-environment discovery from maps of variables: each launcher family, their priority,
//! defaults, and every kind of missing, malformed or contradictory value (each error names its
//! variable).

use std::collections::HashMap;
use std::time::Duration;

use oxiflow_collectives::env::{BackendChoice, LaunchEnv, DEFAULT_TIMEOUT};
use oxiflow_collectives::CommError;

fn read(pairs: &[(&str, &str)]) -> Result<LaunchEnv, CommError> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    LaunchEnv::from_vars(|k| map.get(k).cloned())
}

fn ok(pairs: &[(&str, &str)]) -> LaunchEnv {
    read(pairs).unwrap_or_else(|e| panic!("{pairs:?}: {e}"))
}

/// The error's message, which must mention every word in `names`.
fn err(pairs: &[(&str, &str)], names: &[&str]) -> String {
    let e = read(pairs).expect_err(&format!("{pairs:?} should be refused"));
    assert!(matches!(e, CommError::Env(_)), "{e:?}");
    let msg = e.to_string();
    for n in names {
        assert!(msg.contains(n), "{pairs:?}: {msg:?} does not name {n}");
    }
    msg
}

const MASTER: [(&str, &str); 2] = [("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")];

fn with(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    let mut v = MASTER.to_vec();
    v.extend_from_slice(extra);
    v
}

#[test]
fn nothing_set_is_a_single_process() {
    let e = ok(&[]);
    assert_eq!(
        (e.rank, e.world_size, e.local_rank, e.local_world_size),
        (0, 1, 0, 1)
    );
    assert_eq!(e.node_rank, None);
    assert_eq!(e.master_addr, "127.0.0.1");
    assert_eq!(e.master_port, 0);
    assert_eq!(e.token, None);
    assert_eq!(e.timeout, DEFAULT_TIMEOUT);
    assert_eq!(e.backend, BackendChoice::Auto);
    assert!(e
        .require_token()
        .unwrap_err()
        .to_string()
        .contains("OXIFLOW_TOKEN"));
}

#[test]
fn torchrun_names() {
    let e = ok(&with(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("GROUP_RANK", "1"),
        ("OXIFLOW_TOKEN", "abc123"),
        ("OXIFLOW_TIMEOUT", "2.5"),
        ("OXIFLOW_BACKEND", "CPU"),
    ]));
    assert_eq!(
        (e.rank, e.world_size, e.local_rank, e.local_world_size),
        (5, 8, 1, 4)
    );
    assert_eq!(e.node_rank, Some(1));
    assert_eq!((e.master_addr.as_str(), e.master_port), ("10.0.0.1", 29500));
    assert_eq!(e.store_addr(), "10.0.0.1:29500");
    assert_eq!(e.token.as_deref(), Some("abc123"));
    assert_eq!(e.require_token().unwrap(), "abc123");
    assert_eq!(e.timeout, Duration::from_millis(2500));
    assert_eq!(e.backend, BackendChoice::Cpu);
}

#[test]
fn open_mpi_names() {
    let e = ok(&with(&[
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ]));
    assert_eq!(
        (e.rank, e.world_size, e.local_rank, e.local_world_size),
        (3, 4, 1, 2)
    );
    assert_eq!(e.node_rank, None);
}

#[test]
fn pmi_names() {
    let e = ok(&with(&[
        ("PMI_RANK", "2"),
        ("PMI_SIZE", "3"),
        ("MPI_LOCALRANKID", "2"),
        ("MPI_LOCALNRANKS", "3"),
    ]));
    assert_eq!(
        (e.rank, e.world_size, e.local_rank, e.local_world_size),
        (2, 3, 2, 3)
    );
}

#[test]
fn slurm_names_with_task_lists() {
    let e = ok(&with(&[
        ("SLURM_PROCID", "6"),
        ("SLURM_NTASKS", "7"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_NODEID", "3"),
        ("SLURM_STEP_TASKS_PER_NODE", "2(x3),1"),
    ]));
    assert_eq!(
        (e.rank, e.world_size, e.local_rank, e.local_world_size),
        (6, 7, 0, 1)
    );
    assert_eq!(e.node_rank, Some(3));
    // SLURM_TASKS_PER_NODE as the fallback; uniform list without a node id.
    let e = ok(&with(&[
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_TASKS_PER_NODE", "4(x2)"),
    ]));
    assert_eq!(
        (e.local_rank, e.local_world_size, e.node_rank),
        (1, 4, None)
    );
    err(
        &with(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x"),
        ]),
        &["SLURM_STEP_TASKS_PER_NODE", "2(x"],
    );
    err(
        &with(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "5"),
            ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
        ]),
        &["SLURM_NODEID=5", "2 node(s)"],
    );
}

#[test]
fn families_are_tried_in_contract_order() {
    // torchrun names win over Open MPI, which wins over PMI, which wins over Slurm; the outer
    // launchers here describe jobs of other sizes (one launcher per node), so no contradiction.
    let e = ok(&with(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
    ]));
    assert_eq!((e.rank, e.world_size), (1, 8));
    let e = ok(&with(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("PMI_RANK", "0"),
        ("PMI_SIZE", "5"),
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "4"),
    ]));
    assert_eq!((e.rank, e.world_size), (1, 2));
    let e = ok(&with(&[
        ("PMI_RANK", "3"),
        ("PMI_SIZE", "4"),
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "4"),
    ]));
    assert_eq!(
        (e.rank, e.world_size),
        (3, 4),
        "MPI inside a Slurm batch step is not checked against it"
    );
}

#[test]
fn torchrun_names_under_a_per_node_launcher_may_differ_from_slurm() {
    // torchrun (GROUP_RANK/TORCHELASTIC_RUN_ID) started by srun with one task per node.
    let e = ok(&with(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "1"),
        ("GROUP_RANK", "1"),
        ("TORCHELASTIC_RUN_ID", "none"),
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
    ]));
    assert_eq!(
        (e.rank, e.node_rank),
        (1, Some(1)),
        "rank from RANK, not SLURM_PROCID"
    );
}

#[test]
fn hand_set_torchrun_names_contradicting_slurm_are_refused() {
    err(
        &with(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
        ]),
        &["RANK=0", "SLURM_PROCID=2", "torchrun", "Slurm"],
    );
    err(
        &with(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ]),
        &["RANK=1", "OMPI_COMM_WORLD_RANK=0"],
    );
    err(
        &with(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
        ]),
        &["LOCAL_RANK=0", "MPI_LOCALRANKID=1"],
    );
    // Agreeing is fine.
    let e = ok(&with(&[
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("SLURM_PROCID", "2"),
        ("SLURM_NTASKS", "4"),
    ]));
    assert_eq!(e.rank, 2);
}

#[test]
fn missing_variables_are_named() {
    err(
        &with(&[("RANK", "0")]),
        &["WORLD_SIZE is missing", "RANK is set"],
    );
    err(
        &with(&[("WORLD_SIZE", "2")]),
        &["RANK is missing", "WORLD_SIZE is set"],
    );
    err(
        &with(&[("OMPI_COMM_WORLD_RANK", "0")]),
        &["OMPI_COMM_WORLD_SIZE is missing"],
    );
    err(&with(&[("PMI_SIZE", "2")]), &["PMI_RANK is missing"]);
    err(
        &with(&[("SLURM_PROCID", "0")]),
        &["SLURM_NTASKS is missing"],
    );
    err(
        &with(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]),
        &["LOCAL_WORLD_SIZE is missing"],
    );
    err(
        &with(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
        ]),
        &["LOCAL_RANK is missing"],
    );
    err(
        &with(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
        ]),
        &["SLURM_STEP_TASKS_PER_NODE is missing"],
    );
    err(
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
        &["MASTER_PORT is missing", "WORLD_SIZE=2"],
    );
    err(
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_PORT", "1234"),
        ],
        &["MASTER_ADDR is missing", "several nodes"],
    );
}

#[test]
fn single_node_defaults() {
    // All ranks local: MASTER_ADDR defaults to loopback; the port is still required.
    let e = ok(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "4000")]);
    assert_eq!(
        (e.local_rank, e.local_world_size),
        (1, 2),
        "no local variables: one node"
    );
    assert_eq!(e.store_addr(), "127.0.0.1:4000");
    let e = ok(&[("RANK", "0"), ("WORLD_SIZE", "1")]);
    assert_eq!(e.master_port, 0);
    let e = ok(&[("MASTER_ADDR", "::1"), ("MASTER_PORT", "5")]);
    assert_eq!(e.store_addr(), "[::1]:5");
}

#[test]
fn malformed_values_are_named() {
    err(
        &with(&[("RANK", "one"), ("WORLD_SIZE", "2")]),
        &["RANK=\"one\"", "integer"],
    );
    err(
        &with(&[("RANK", "-1"), ("WORLD_SIZE", "2")]),
        &["RANK=\"-1\""],
    );
    err(&with(&[("RANK", ""), ("WORLD_SIZE", "2")]), &["RANK=\"\""]);
    err(
        &with(&[("RANK", "0"), ("WORLD_SIZE", "2x")]),
        &["WORLD_SIZE=\"2x\""],
    );
    err(
        &with(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "two"),
        ]),
        &["OMPI_COMM_WORLD_SIZE=\"two\""],
    );
    err(
        &[("MASTER_PORT", "70000")],
        &["MASTER_PORT=\"70000\"", "port"],
    );
    err(&[("MASTER_PORT", "http")], &["MASTER_PORT=\"http\""]);
    err(&[("MASTER_ADDR", "a b")], &["MASTER_ADDR"]);
    err(&[("MASTER_ADDR", "")], &["MASTER_ADDR"]);
    err(
        &[("OXIFLOW_TIMEOUT", "soon")],
        &["OXIFLOW_TIMEOUT=\"soon\""],
    );
    err(&[("OXIFLOW_TIMEOUT", "0")], &["OXIFLOW_TIMEOUT=\"0\""]);
    err(&[("OXIFLOW_TIMEOUT", "-3")], &["OXIFLOW_TIMEOUT"]);
    err(&[("OXIFLOW_TIMEOUT", "inf")], &["OXIFLOW_TIMEOUT"]);
    err(
        &[("OXIFLOW_BACKEND", "gloo")],
        &["OXIFLOW_BACKEND=\"gloo\"", "auto, nccl, cpu"],
    );
    err(&[("NODE_RANK", "x")], &["NODE_RANK=\"x\""]);
    let msg = err(&[("OXIFLOW_TOKEN", "has space")], &["OXIFLOW_TOKEN"]);
    assert!(
        !msg.contains("has space"),
        "the token's value must not be printed: {msg}"
    );
    err(&[("OXIFLOW_TOKEN", "")], &["OXIFLOW_TOKEN", "empty"]);
}

#[test]
fn contradictory_values_within_a_family_are_named() {
    err(
        &with(&[("RANK", "4"), ("WORLD_SIZE", "4")]),
        &["RANK=4", "WORLD_SIZE=4"],
    );
    err(
        &with(&[("RANK", "0"), ("WORLD_SIZE", "0")]),
        &["WORLD_SIZE=0"],
    );
    err(
        &with(&[("OMPI_COMM_WORLD_RANK", "9"), ("OMPI_COMM_WORLD_SIZE", "2")]),
        &["OMPI_COMM_WORLD_RANK=9", "OMPI_COMM_WORLD_SIZE=2"],
    );
    err(
        &with(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
        ]),
        &["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"],
    );
    err(
        &with(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "3"),
        ]),
        &["LOCAL_WORLD_SIZE=3"],
    );
    err(
        &with(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "0"),
        ]),
        &["LOCAL_WORLD_SIZE=0"],
    );
    err(
        &with(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("NODE_RANK", "1"),
            ("GROUP_RANK", "0"),
        ]),
        &["NODE_RANK=1", "GROUP_RANK=0"],
    );
    err(
        &with(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("NODE_RANK", "2")]),
        &["NODE_RANK=2"],
    );
    err(
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "0")],
        &["MASTER_PORT=0"],
    );
}

#[test]
fn backend_names_parse_case_insensitively() {
    for (s, b) in [
        ("auto", BackendChoice::Auto),
        ("NCCL", BackendChoice::Nccl),
        (" cpu ", BackendChoice::Cpu),
    ] {
        assert_eq!(s.parse::<BackendChoice>().unwrap(), b);
        assert_eq!(b.to_string().parse::<BackendChoice>().unwrap(), b);
    }
}

#[test]
fn shared_memory_switch() {
    assert!(ok(&[]).shm, "on by default");
    assert!(!ok(&[("OXIFLOW_SHM", "0")]).shm);
    assert!(ok(&[("OXIFLOW_SHM", "on")]).shm);
    err(&[("OXIFLOW_SHM", "maybe")], &["OXIFLOW_SHM=\"maybe\""]);
}

#[test]
fn oflaunch_extras_prefix_device_and_library_folders() {
    let e = ok(&with(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("OXIFLOW_STORE_PREFIX", "job/g3/"),
        ("OXIFLOW_DEVICE", "5"),
        ("OXIFLOW_CUDA_LIB_DIRS", "/opt/a::/opt/b"),
    ]));
    assert_eq!(e.store_prefix, "job/g3/");
    assert_eq!(e.device_ordinal(), 5);
    assert_eq!(
        e.cuda_lib_dirs,
        vec![
            std::path::PathBuf::from("/opt/a"),
            std::path::PathBuf::from("/opt/b")
        ]
    );
    let plain = ok(&with(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
    ]));
    assert_eq!(plain.store_prefix, "");
    assert_eq!(
        plain.device_ordinal(),
        1,
        "without OXIFLOW_DEVICE the local rank picks the GPU"
    );
    err(
        &with(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("OXIFLOW_DEVICE", "gpu0"),
        ]),
        &["OXIFLOW_DEVICE", "gpu0"],
    );
}

#[test]
fn nccl_memory_is_off_unless_set_to_one() {
    assert!(!ok(&[]).nccl_memory);
    assert!(!ok(&[("OXIFLOW_NCCL_MEMORY", "0")]).nccl_memory);
    assert!(ok(&[("OXIFLOW_NCCL_MEMORY", "1")]).nccl_memory);
    err(
        &[("OXIFLOW_NCCL_MEMORY", "yes")],
        &["OXIFLOW_NCCL_MEMORY", "yes"],
    );
}

#[test]
fn oflaunchs_contract_variables_and_folders_are_checked() {
    let pair = [("RANK", "1"), ("WORLD_SIZE", "2")];
    let read_with = |extra: &[(&'static str, &'static str)]| {
        let mut v = with(&pair);
        v.extend_from_slice(extra);
        v
    };
    assert_eq!(ok(&read_with(&[])).restart_count, 0);
    assert_eq!(
        ok(&read_with(&[("OXIFLOW_RESTART_COUNT", "2")])).restart_count,
        2
    );
    for (var, value) in [
        ("OXIFLOW_RESTART_COUNT", "abc"),
        ("OXIFLOW_RESTART_COUNT", "-1"),
        ("OXIFLOW_NNODES", "0"),
        ("OXIFLOW_NNODES", "3"),
        ("OXIFLOW_STORE_PREFIX", "job g0/"),
        ("OXIFLOW_CUDA_GRAPH", "on"),
        ("OXIFLOW_TRACE_DIR", ""),
        ("OXIFLOW_FLIGHT_DIR", "  "),
    ] {
        err(&read_with(&[(var, value)]), &[var, &format!("{value:?}")]);
    }
    ok(&read_with(&[
        ("OXIFLOW_NNODES", "2"),
        ("OXIFLOW_CUDA_GRAPH", "0"),
    ]));
    let addressed = |addr: &'static str| {
        [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", addr),
            ("MASTER_PORT", "1"),
        ]
    };
    for addr in ["host!", "a/b", "10.0.0.1:29500"] {
        err(&addressed(addr), &["MASTER_ADDR", addr]);
    }
    for addr in ["::1", "[fe80::1%eth0]", "node-7.cluster_a"] {
        ok(&addressed(addr));
    }
    // The folders: ones that cannot hold files, and library folders that do not exist.
    let e = ok(&read_with(&[("OXIFLOW_TRACE_DIR", "/proc/traces")]));
    let msg = e.check_folders().unwrap_err().to_string();
    assert!(
        msg.contains("OXIFLOW_TRACE_DIR=\"/proc/traces\"") && msg.contains("procfs"),
        "{msg}"
    );
    let e = ok(&read_with(&[(
        "OXIFLOW_CUDA_LIB_DIRS",
        "/tmp:/no/such/lib",
    )]));
    let msg = e.check_folders().unwrap_err().to_string();
    assert!(msg.contains("/no/such/lib is not a folder"), "{msg}");
    let e = ok(&read_with(&[(
        "OXIFLOW_FLIGHT_DIR",
        "/tmp/oxiflow-not-yet",
    )]));
    assert!(e.check_folders().is_ok());
    // A misspelt name is refused, naming the one meant; other unknown names pass.
    let names = |n: &[&str]| {
        oxiflow_collectives::env::check_variable_names(n.iter().map(|s| s.to_string()))
    };
    let msg = names(&["PATH", "OXIFLOW_TIMOUT"]).unwrap_err().to_string();
    assert!(msg.contains("did you mean OXIFLOW_TIMEOUT?"), "{msg}");
    assert!(names(&["OXIFLOW_TEST_BINS", "OXIFLOW_TIMEOUT"]).is_ok());
}
