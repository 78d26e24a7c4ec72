//! A TCP proxy on loopback that can be taken down and brought back: a dead object store, as
//! its clients see one (connections refused or cut), with its data intact behind it.

use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Forwards connections on its own port to `127.0.0.1:target`.
pub struct TcpProxy {
    pub port: u16,
    up: Arc<AtomicBool>,
    open: Arc<Mutex<Vec<TcpStream>>>,
}

impl TcpProxy {
    pub fn start(target: u16) -> TcpProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port for the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let (up, open) = (Arc::new(AtomicBool::new(true)), Arc::new(Mutex::new(Vec::new())));
        let (accepting_up, accepting_open) = (up.clone(), open.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if !accepting_up.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else { continue };
                let mut open = accepting_open.lock().unwrap();
                for stream in [&client, &server] {
                    open.extend(stream.try_clone());
                }
                pipe(&client, &server);
                pipe(&server, &client);
            }
        });
        TcpProxy { port, up, open }
    }

    /// Cuts every open connection and refuses new ones until [`TcpProxy::bring_up`].
    pub fn take_down(&self) {
        self.up.store(false, Ordering::SeqCst);
        for stream in self.open.lock().unwrap().drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    pub fn bring_up(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

/// Copies `from` to `to` in a thread of its own.
fn pipe(from: &TcpStream, to: &TcpStream) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else { return };
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from, &mut to);
        let _ = to.shutdown(Shutdown::Write);
    });
}
