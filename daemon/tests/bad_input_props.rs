//! Bad input never panics the daemon, and damage is detected: property tests over what
//! stasisd reads from outside itself. The store's envelopes (manifests, pack indexes), CRIU's
//! page-server stream, its lazy-pages socket and inventory image, and whole manifests handed
//! to a restore's assembly,
//! from a random generator (100,000 cases per decoder; fewer for the assembly, which writes
//! files). proptest shrinks a failure to a minimal input.

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use stasis_daemon::criu::images::dump_run_id;
use stasis_daemon::criu::lazy_socket::{LazyListener, SOCKET_NAME};
use stasis_daemon::criu::pageserver::{HeaderLayout, serve};
use stasis_daemon::store::crypto::{Cipher, StoreKey};
use stasis_daemon::store::envelope::{self, MANIFEST, PACK_INDEX};
use stasis_daemon::store::{Manifest, MemoryMode, Staging, Store};
use stasis_proto::stasis::store::v1::{ChunkRef, FileImage, MemoryImage, PackEntry, PackIndex, PageRun};

const DECODER_CASES: u32 = 100_000;

/// One scratch directory for all cases of a test (cases run one after another).
fn scratch() -> &'static std::path::Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().unwrap()).path()
}

fn decoder_config() -> ProptestConfig {
    ProptestConfig { cases: DECODER_CASES, failure_persistence: None, ..ProptestConfig::default() }
}

fn sample_manifest() -> Manifest {
    Manifest {
        id: "20261123-000000-abcdef".into(),
        workload: "w".into(),
        pids: vec![42, 43],
        files: vec![FileImage { name: "core-42.img".into(), size: 10, chunks: vec![] }],
        ..Default::default()
    }
}

/// An encrypted store's cipher (the same for every case).
fn cipher() -> &'static Cipher {
    static CIPHER: std::sync::OnceLock<Cipher> = std::sync::OnceLock::new();
    CIPHER.get_or_init(|| StoreKey::from_hex(&"5a".repeat(32)).unwrap().new_keys_object().1)
}

fn sample_index() -> PackIndex {
    let entry = PackEntry {
        hash: vec![7; 32],
        offset: 0,
        stored_len: 100,
        len: 4096,
        codec: 1,
        stored_checksum: vec![],
    };
    PackIndex { pack: "n-1".into(), entries: vec![entry; 3] }
}

proptest! {
    #![proptest_config(decoder_config())]

    #[test]
    fn envelopes_of_any_bytes_are_refused_or_read_never_panic(data in proptest::collection::vec(any::<u8>(), 0..600)) {
        for key in [None, Some(cipher())] {
            let _ = envelope::decode::<Manifest>(MANIFEST, &data, key);
            let _ = envelope::decode::<PackIndex>(PACK_INDEX, &data, key);
        }
    }

    #[test]
    fn any_damage_to_an_envelope_is_detected(
        which in any::<bool>(),
        sealed in any::<bool>(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 1..4),
        cut in proptest::option::of(any::<prop::sample::Index>()),
    ) {
        let key = sealed.then(cipher);
        let original = if which {
            envelope::encode(MANIFEST, &sample_manifest(), key)
        } else {
            envelope::encode(PACK_INDEX, &sample_index(), key)
        };
        let mut damaged = original.clone();
        for (at, mask) in &flips {
            let i = at.index(damaged.len());
            damaged[i] ^= mask;
        }
        if let Some(cut) = cut {
            damaged.truncate(cut.index(damaged.len()));
        }
        prop_assume!(damaged != original);
        if which {
            // Only a change of the minor version within what is read (1.0 and 1.1, which the
            // checksum does not cover) may read back, and then as the same manifest.
            let version_only = damaged.len() == original.len() && damaged[..10] == original[..10]
                && damaged[12..] == original[12..];
            match envelope::decode::<Manifest>(MANIFEST, &damaged, key) {
                Err(_) => {}
                Ok(read) => prop_assert!(version_only && read == sample_manifest()),
            }
        } else {
            prop_assert!(envelope::decode::<PackIndex>(PACK_INDEX, &damaged, key).is_err());
        }
    }

    #[test]
    fn any_page_server_stream_is_served_or_refused_never_panics(
        commands in proptest::collection::vec(
            (
                prop_oneof![Just(1u32), Just(2), Just(3), Just(4), Just(5), Just(6), Just(7), Just(0x1023), any::<u32>()],
                any::<u16>(),
                prop_oneof![0u64..64, any::<u64>()],
                prop_oneof![(0u64..1 << 20).prop_map(|p| p << 12), any::<u64>()],
                any::<u64>(),
                0usize..9000,
            ),
            0..6,
        ),
        narrow in any::<bool>(),
    ) {
        let layout = if narrow { HeaderLayout::Narrow } else { HeaderLayout::Wide };
        let mut stream = Vec::new();
        for (cmd, flags, nr_pages, vaddr, dst_id, payload) in commands {
            stream.extend((cmd | u32::from(flags) << 16).to_ne_bytes());
            if narrow {
                stream.extend((nr_pages as u32).to_ne_bytes());
            } else {
                stream.extend([0u8; 4]);
                stream.extend(nr_pages.to_ne_bytes());
            }
            stream.extend(vaddr.to_ne_bytes());
            stream.extend(dst_id.to_ne_bytes());
            stream.extend(std::iter::repeat_n(0xa5u8, payload));
        }
        let mut staging = Staging::new(&stasis_daemon::store::StagingBudget::new(64 << 10), &scratch().join("page-server.spill"));
        let mut conn = Wire { input: std::io::Cursor::new(stream), output: Vec::new() };
        if let Ok(stats) = serve(&mut conn, layout, &mut staging, None) {
            let staged = staging.finish().unwrap();
            prop_assert_eq!(staged.len(), stats.bytes, "what was acknowledged is what is staged");
        }
    }

    #[test]
    fn any_inventory_image_gives_a_run_id_or_an_error(data in proptest::collection::vec(any::<u8>(), 0..200)) {
        let dir = scratch().join("inventory");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("inventory.img"), &data).unwrap();
        let _ = dump_run_id(&dir);
    }
}

proptest! {
    // A socket per case: fewer cases.
    #![proptest_config(ProptestConfig { cases: 5_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_lazy_pages_socket_stream_is_read_or_refused_never_panics(
        words in proptest::collection::vec(
            prop_oneof![Just(0x5253_5446u32), (0u32..50), any::<u32>()],
            0..8,
        ),
        processes in 0usize..4,
    ) {
        // What a restore sends: pids (a live one is followed by one byte, here without the
        // descriptor it should carry), zombies' negative pids, the end word.
        let dir = scratch().join("lazy-socket");
        std::fs::create_dir_all(&dir).unwrap();
        let listener = LazyListener::bind(&dir).unwrap();
        let mut client = std::os::unix::net::UnixStream::connect(dir.join(SOCKET_NAME)).unwrap();
        let mut conn = listener.accept(processes).unwrap().expect("the connection");
        let mut stream = Vec::new();
        for w in words {
            stream.extend(w.to_ne_bytes());
            if (w as i32) >= 0 && w != 0x5253_5446 {
                stream.push(0);
            }
        }
        std::io::Write::write_all(&mut client, &stream).unwrap();
        drop(client);
        let mut announced = 0;
        for _ in 0..3 {
            match conn.read() {
                Ok(said) => announced += said.len(),
                Err(_) => break,
            }
        }
        // Without descriptors, only zombies and the end can be announced.
        prop_assert!(announced <= processes + 1);
    }
}

/// A page-server connection that reads a script and records the answers.
struct Wire {
    input: std::io::Cursor<Vec<u8>>,
    output: Vec<u8>,
}

impl std::io::Read for Wire {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl std::io::Write for Wire {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.output.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn chunk_ref() -> impl Strategy<Value = ChunkRef> {
    (
        prop_oneof![Just(vec![]), Just(vec![7u8; 32]), proptest::collection::vec(any::<u8>(), 0..40)],
        any::<u32>(),
        prop_oneof![Just(0u32), 0u32..(1 << 17), any::<u32>()],
    )
        .prop_map(|(hash, len, offset)| ChunkRef { hash, len: len % (1 << 17), fresh: false, offset })
}

fn manifest() -> impl Strategy<Value = Manifest> {
    let run =
        (any::<u64>(), prop_oneof![0u64..40, any::<u64>()], prop_oneof![Just(4u32), Just(6), any::<u32>()])
            .prop_map(|(vaddr, nr_pages, flags)| PageRun { vaddr, nr_pages, flags });
    let image = (
        prop_oneof![Just(42u64 << 8 | 1), Just(7u64 << 8 | 2), any::<u64>()],
        proptest::collection::vec(run, 0..4),
        proptest::collection::vec(chunk_ref(), 0..6),
    )
        .prop_map(|(dst_id, runs, chunks)| MemoryImage { dst_id, runs, chunks });
    let file = ("[a-z./]{0,12}", any::<u64>(), proptest::collection::vec(chunk_ref(), 0..4))
        .prop_map(|(name, size, chunks)| FileImage { name, size: size % (1 << 20), chunks });
    (proptest::collection::vec(image, 0..3), proptest::collection::vec(file, 0..3)).prop_map(
        |(memory, files)| Manifest {
            id: "20261123-000000-abcdef".into(),
            memory,
            files,
            ..Default::default()
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_manifest_is_assembled_or_refused_never_panics(m in manifest(), lazy in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&format!("file://{}", dir.path().join("store").display()), Duration::from_millis(10)).unwrap();
        let out = dir.path().join("restore");
        std::fs::create_dir_all(&out).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let mode = if lazy { MemoryMode::Lazy { eager: &[] } } else { MemoryMode::Eager };
        let _ = runtime.block_on(store.materialize_as(&m, &out, mode, Arc::new(|_, _| {})));
    }
}
