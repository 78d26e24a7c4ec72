//! What the fake's processes run, as far as their /proc tells: the files each maps and the
//! environment it started with; and the kernel release the fake reports. Only the checks that
//! depend on the kernel (`inspect::kernel_refusal`) ask.

use std::collections::HashMap;
use std::sync::Mutex;

/// The release a fake reports unless a test sets another: one where CRIU dumps everything.
const RELEASE: &str = "6.18.0-fake";

#[derive(Debug, Default)]
pub struct FakePrograms {
    /// The kernel release (else [`RELEASE`]).
    pub release: Mutex<Option<String>>,
    /// The files each process maps (none, for those not listed).
    pub mapped: Mutex<HashMap<i32, Vec<String>>>,
    /// The environment each process started with, as `NAME=value` entries (unreadable, for
    /// those not listed).
    pub environment: Mutex<HashMap<i32, Vec<String>>>,
}

impl FakePrograms {
    /// Makes the fake's kernel release `release`.
    pub fn set_release(&self, release: &str) {
        *self.release.lock().unwrap() = Some(release.into());
    }

    /// Makes `pid` a program that maps `mapped` and started with `environment`.
    pub fn set(&self, pid: i32, mapped: &[&str], environment: &[&str]) {
        let owned = |list: &[&str]| list.iter().map(|s| s.to_string()).collect();
        self.mapped.lock().unwrap().insert(pid, owned(mapped));
        self.environment.lock().unwrap().insert(pid, owned(environment));
    }

    pub(super) fn release(&self) -> String {
        self.release.lock().unwrap().clone().unwrap_or_else(|| RELEASE.into())
    }

    pub(super) fn mapped(&self, pid: i32) -> Vec<String> {
        self.mapped.lock().unwrap().get(&pid).cloned().unwrap_or_default()
    }

    pub(super) fn environment(&self, pid: i32) -> Option<Vec<String>> {
        self.environment.lock().unwrap().get(&pid).cloned()
    }
}
