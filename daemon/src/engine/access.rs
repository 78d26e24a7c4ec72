//! Who may act on what. stasisd's socket is root's alone by default; with `--socket-group`
//! members of a group may connect too, and each acts only on what is its own: processes whose
//! user ids are all its uid, workloads it started, and checkpoints of such trees. Root acts on
//! everything.

use std::collections::BTreeSet;

/// On whose behalf an operation runs (from the caller's `SO_PEERCRED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Caller {
    #[default]
    Root,
    User {
        uid: u32,
        gid: u32,
    },
}

impl Caller {
    /// The caller for credentials `uid`/`gid`.
    pub fn from_ids(uid: u32, gid: u32) -> Caller {
        if uid == 0 { Caller::Root } else { Caller::User { uid, gid } }
    }

    /// Whether the caller may act on what `owner` owns.
    pub fn owns(&self, owner: u32) -> bool {
        match self {
            Caller::Root => true,
            Caller::User { uid, .. } => *uid == owner,
        }
    }

    pub fn uid(&self) -> u32 {
        match self {
            Caller::Root => 0,
            Caller::User { uid, .. } => *uid,
        }
    }
}

/// The owner of a tree whose processes have the user ids `uids`: their one uid, or root when
/// they have several (a tree with a set-uid child is no single user's).
pub fn owner_of(uids: &BTreeSet<u32>) -> u32 {
    match (uids.first(), uids.len()) {
        (Some(&only), 1) => only,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_own_only_their_own_and_mixed_trees_are_roots() {
        let user = Caller::from_ids(1000, 1000);
        assert!(user.owns(1000) && !user.owns(0) && !user.owns(1001));
        assert!(Caller::from_ids(0, 0).owns(1000));
        assert_eq!(owner_of(&BTreeSet::from([1000])), 1000);
        assert_eq!(owner_of(&BTreeSet::from([0, 1000])), 0);
        assert_eq!(owner_of(&BTreeSet::new()), 0);
    }
}
