//! Who a restored tree becomes: the workload name it may take, its home on this node, its
//! processes' pids after the restore, and its record in the workload registry.

use tracing::warn;

use super::Placement;
use crate::engine::home::{Home, init_dir_again};
use crate::engine::workloads::{Workload, is_container_name, valid_name};
use crate::engine::{Caller, Engine, RestoreError};
use crate::store::Manifest;

impl Engine {
    /// The home on this node of the tree restored as `name`: its log, its cgroup if it had
    /// one, and its namespace init's directory made again if it is gone.
    pub(super) fn restored_home(
        &self,
        manifest: &Manifest,
        name: &str,
        caller: Caller,
    ) -> Result<Home, RestoreError> {
        let home = self
            .home(name, caller, !manifest.cgroup.is_empty())
            .map_err(|(what, e)| RestoreError::local(what)(e))?;
        if !manifest.init_dir.is_empty() {
            init_dir_again(&manifest.init_dir).map_err(RestoreError::local("its init's directory"))?;
        }
        Ok(home)
    }

    /// Whether the restored tree may be workload `name`: not a reclaimed one, and a name of
    /// its own (`--as`) only for a tree with its own pid namespace, and not one that runs.
    pub(super) fn check_name(
        &self,
        manifest: &Manifest,
        name: &str,
        caller: Caller,
    ) -> Result<(), RestoreError> {
        let existing = self.registry.get(name);
        if existing.as_ref().is_some_and(|w| w.reclaimed.is_some()) {
            return Err(RestoreError::Reclaimed(name.to_owned()));
        }
        let runs = existing.as_ref().is_some_and(|w| self.deps.host.is_running(w.pid));
        if caller != Caller::Root && is_container_name(name) {
            let why = "names beginning with k8s. are Kubernetes containers', and root's";
            return Err(RestoreError::BadName { name: name.to_owned(), why });
        }
        if name == manifest.workload {
            return match runs && manifest.own_pid_namespace {
                // Its pids would not stop it, but the workload's record would lose the one running.
                true => Err(RestoreError::BadName {
                    name: name.to_owned(),
                    why: "it runs already; give another copy a name of its own with --as",
                }),
                false => Ok(()),
            };
        }
        let why = if !valid_name(name) {
            "it is not a valid workload name"
        } else if !manifest.own_pid_namespace {
            "it keeps its pids (a process checkpointed by pid, or run with --host-pids), so only one copy can run"
        } else if runs || existing.is_some_and(|w| !caller.owns(w.owner_uid)) {
            "a running workload (or another user's) has that name"
        } else {
            return Ok(());
        };
        Err(RestoreError::BadName { name: name.to_owned(), why })
    }

    /// The pids that `pids` (as the checkpoint recorded them) have in the tree restored with
    /// root `root`: the same, unless the tree has its own pid namespace or was a container's,
    /// whose restore numbers them anew outside it (matched by their pids inside it).
    pub(super) fn restored_pids(&self, manifest: &Manifest, root: i32, pids: &[i32]) -> Vec<i32> {
        let inner_pids = match (manifest.own_pid_namespace, &manifest.pod) {
            (true, _) => &manifest.ns_pids,
            (false, Some(pod)) => &pod.inner_pids,
            (false, None) => return pids.to_vec(),
        };
        let now: Vec<(i32, Option<i32>)> = self
            .deps
            .host
            .trees(&[root])
            .into_iter()
            .map(|p| (p, self.deps.host.pid_inside(p, root)))
            .collect();
        let inside = |pid: &i32| {
            let at = manifest.pids.iter().position(|p| p == pid)?;
            let ns_pid = *inner_pids.get(at)?;
            now.iter().find(|(_, inner)| *inner == Some(ns_pid)).map(|(p, _)| *p)
        };
        pids.iter().filter_map(inside).collect()
    }

    /// Records the restored tree in the workload registry. A failure is logged, not
    /// returned: the tree runs, and the registry is bookkeeping.
    pub(super) fn remember_restore(&self, manifest: &Manifest, placement: &Placement, name: &str, pid: i32) {
        let recorded = match placement {
            Placement::Home(home) => self.record_restore(manifest, home, name, pid),
            Placement::Container(_) => self.registry.update(name, |w| {
                w.pid = pid;
                w.last_checkpoint = Some(manifest.id.clone());
                w.last_error = None;
            }),
        };
        if let Err(e) = recorded {
            warn!(workload = %name, error = %e, "cannot record the restore in the workload registry");
        }
    }

    pub(super) fn record_restore(
        &self,
        manifest: &Manifest,
        home: &Home,
        name: &str,
        pid: i32,
    ) -> std::io::Result<()> {
        let cgroup = home.cgroup.clone();
        // A copy (`--as`) gets a record of its own, even over an old one of that name.
        if name == manifest.workload && self.registry.get(name).is_some() {
            return self.registry.update(name, |w| {
                w.pid = pid;
                w.last_error = None;
                w.cgroup = cgroup;
            });
        }
        self.registry.put(Workload {
            name: name.to_owned(),
            pid,
            command: manifest.command.clone(),
            managed: !manifest.log_file.is_empty(),
            log_path: Some(home.log_path.clone()),
            cgroup,
            last_checkpoint: Some(manifest.id.clone()),
            owner_uid: manifest.owner_uid,
            ..Default::default()
        })
    }
}
