//! The registry of workloads: named process trees stasisd started or checkpointed, persisted
//! in the state directory so a restarted daemon still knows them.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// What stasisd knows of one workload.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    pub name: String,
    /// Root pid of the tree's current incarnation.
    pub pid: i32,
    pub command: Vec<String>,
    /// Started by `stasis run` (stasisd owns its stdio and cgroup).
    pub managed: bool,
    pub log_path: Option<PathBuf>,
    pub cgroup: Option<PathBuf>,
    pub last_checkpoint: Option<String>,
    /// Why its last restore failed after the tree ran (a lazy restore whose memory stopped
    /// arriving), for callers that did not wait; cleared by the next restore or checkpoint.
    #[serde(default)]
    pub last_error: Option<String>,
    /// The user it runs as (0: root), who may act on it besides root.
    #[serde(default)]
    pub owner_uid: u32,
    /// Reclaimed after this long without activity (see `engine/idle/`); `None`: never.
    #[serde(default)]
    pub idle_after_ms: Option<u64>,
    /// A `--leave-running` checkpoint this often (see `engine/periodic.rs`); `None`: never.
    #[serde(default)]
    pub checkpoint_every_ms: Option<u64>,
    /// Set while the workload is reclaimed: stopped, waiting for its next use.
    #[serde(default)]
    pub reclaimed: Option<super::idle::Reclaimed>,
    /// Evicted on a preemption notice (see `engine/evacuate/`).
    #[serde(default)]
    pub spot: bool,
    /// What its newest checkpoint cost, for the evacuation planner's estimate.
    #[serde(default)]
    pub last_cost: Option<super::CheckpointCost>,
    /// What the last evacuation did with it.
    #[serde(default)]
    pub evacuation: Option<super::Evacuation>,
    /// The Kubernetes container it runs in (see `engine/pods/`).
    #[serde(default)]
    pub container: Option<super::pods::ContainerRef>,
}

/// Persistent map of workload name to [`Workload`].
#[derive(Debug)]
pub struct Registry {
    file: PathBuf,
    entries: Mutex<BTreeMap<String, Workload>>,
}

impl Registry {
    /// Loads the registry from `file`; a missing file is an empty registry.
    pub fn load(file: &Path) -> io::Result<Self> {
        let entries = match std::fs::read(file) {
            Ok(data) => serde_json::from_slice(&data).map_err(io::Error::other)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(e),
        };
        Ok(Self { file: file.to_path_buf(), entries: Mutex::new(entries) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Workload>> {
        super::lock(&self.entries)
    }

    pub fn get(&self, name: &str) -> Option<Workload> {
        self.lock().get(name).cloned()
    }

    /// The workload whose current root is `pid`.
    pub fn by_pid(&self, pid: i32) -> Option<Workload> {
        self.lock().values().find(|w| w.pid == pid).cloned()
    }

    pub fn all(&self) -> Vec<Workload> {
        self.lock().values().cloned().collect()
    }

    /// Inserts or replaces a workload and persists the registry.
    pub fn put(&self, workload: Workload) -> io::Result<()> {
        let mut entries = self.lock();
        entries.insert(workload.name.clone(), workload);
        self.save(&entries)
    }

    /// Changes a workload in place and persists; does nothing for an unknown name.
    pub fn update(&self, name: &str, change: impl FnOnce(&mut Workload)) -> io::Result<()> {
        let mut entries = self.lock();
        if let Some(w) = entries.get_mut(name) {
            change(w);
        }
        self.save(&entries)
    }

    fn save(&self, entries: &BTreeMap<String, Workload>) -> io::Result<()> {
        let data = serde_json::to_vec_pretty(entries).map_err(io::Error::other)?;
        crate::linux::durable_file::replace(&self.file, &data)
    }
}

/// Whether `name` is usable as a workload name (it becomes a file and cgroup name).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 100
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// What the names of Kubernetes containers' workloads start with (`pods::Identity`).
pub const CONTAINER_PREFIX: &str = "k8s.";

/// Whether `name` is one a container's workload takes: only root (the node agent's
/// registration) may give such a name, so that no user holds it when the container comes.
pub fn is_container_name(name: &str) -> bool {
    name.starts_with(CONTAINER_PREFIX)
}

/// A workload name derived from a command: its program's base name plus `suffix`.
pub fn derived_name(program: &str, suffix: &str) -> String {
    let base: String = Path::new(program)
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_') { c } else { '_' })
        .take(40)
        .collect();
    if base.is_empty() { format!("pid-{suffix}") } else { format!("{base}-{suffix}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_save_cut_short_at_any_byte_leaves_the_previous_registry() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("workloads.json");
        let reg = Registry::load(&file).unwrap();
        reg.put(Workload { name: "old".into(), pid: 7, ..Default::default() }).unwrap();
        let mut next = BTreeMap::new();
        next.insert("new".to_string(), Workload { name: "new".into(), pid: 8, ..Default::default() });
        let data = serde_json::to_vec_pretty(&next).unwrap();
        for cut in 0..=data.len() {
            std::fs::write(crate::linux::durable_file::staging_name(&file), &data[..cut]).unwrap();
            let loaded = Registry::load(&file).unwrap();
            assert_eq!(
                loaded.all().iter().map(|w| w.name.as_str()).collect::<Vec<_>>(),
                ["old"],
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn persists_across_loads() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("w.json");
        let reg = Registry::load(&file).unwrap();
        let w = Workload {
            name: "train".into(),
            pid: 10,
            command: vec!["python3".into()],
            managed: true,
            log_path: None,
            cgroup: None,
            last_error: Some("the store did not deliver memory".into()),
            ..Default::default()
        };
        reg.put(w.clone()).unwrap();
        reg.update("train", |w| w.pid = 11).unwrap();
        let again = Registry::load(&file).unwrap();
        assert_eq!(again.get("train").unwrap().pid, 11);
        assert_eq!(again.get("train").unwrap().last_error, w.last_error, "the last error persists");
        assert_eq!(again.by_pid(11).unwrap().name, "train");
        assert!(again.by_pid(10).is_none());
    }

    #[test]
    fn names() {
        assert!(valid_name("train-01.v2"));
        assert!(!valid_name("../etc"));
        assert!(!valid_name(".hidden"));
        assert!(!valid_name("a b"));
        assert_eq!(derived_name("/usr/bin/python3.11", "42"), "python3_11-42");
        assert_eq!(derived_name("", "7"), "pid-7");
    }
}
