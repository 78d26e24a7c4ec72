//! Waking a reclaimed workload on its next use.
//!
//! While a workload is reclaimed, its waker listens on the workload's listening addresses
//! and watches its connections (which CRIU's lock keeps alive for the peers: their segments
//! are dropped and retransmitted, not refused; see uses.rs for how they are seen). The first connection, the
//! first segment with data on a locked connection, or `stasis wake`, starts a lazy restore.
//! Connections the waker accepted are relayed to the restored listeners; the locked
//! connections resume as they were, their peers' retransmissions answered by the restored
//! sockets. New connections that arrive while nothing listens (from the end of the reclaimed
//! tree until the waker listens, and between the waker closing its listeners and the restored
//! ones being there) are held back, not refused: their peers send them again until something
//! answers. A failed wake leaves the workload reclaimed, and the waker listening again.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use super::Reclaimed;
use super::uses::UseWatch;
use crate::engine::host::{Hold, Host, Watches};
use crate::engine::{
    Caller, Engine, PolicyError, RestoreError, RestoreOutcome, RestoreParams, RestoreTarget,
};

/// Why a wake failed, for every caller that waited for it.
type WakeFailure = Arc<RestoreError>;

/// A waiting `stasis wake`.
type WakeReply = oneshot::Sender<Result<RestoreOutcome, WakeFailure>>;

/// How long a failed wake waits before listening again.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// How long a relayed connection waits for the restored listener.
const LISTENER_WAIT: Duration = Duration::from_secs(10);

/// How long the waker tries again to listen on an address in use, and how often.
const ADDRESS_FREED_WAIT: Duration = Duration::from_secs(10);
const ADDRESS_RETRY: Duration = Duration::from_millis(50);

/// How long handshakes under way when new connections are held back get to finish before the
/// waker's listeners close (one that finished after would be reset).
const HANDSHAKES_SETTLE: Duration = Duration::from_millis(20);

/// The waker of one reclaimed workload.
pub(super) struct Waker {
    requests: mpsc::UnboundedSender<WakeReply>,
}

/// What woke the workload.
enum Trigger {
    Connection(TcpStream, SocketAddr),
    Segment(u16),
    Asked(WakeReply),
}

impl Engine {
    /// Starts waiting for the next use of reclaimed workload `name`; returns where a
    /// `stasis wake` asks it.
    ///
    /// `held` holds back new connections to the workload's ports (see
    /// [`Engine::hold_until_listening`]) until the waker listens.
    pub(super) fn arm_waker(
        self: &Arc<Self>,
        name: &str,
        reclaimed: Reclaimed,
        held: Option<Hold>,
    ) -> mpsc::UnboundedSender<WakeReply> {
        let (requests, asked) = mpsc::unbounded_channel();
        self.workloads.with(name, |slot| slot.idle.waker = Some(Waker { requests: requests.clone() }));
        let host = self.deps.host.clone();
        tokio::spawn(wait_and_wake(Arc::downgrade(self), host, name.to_owned(), reclaimed, asked, held));
        requests
    }

    /// Holds back new connections to the listening ports of reclaimed workload `name`, from
    /// the end of its tree until its waker listens: a client that connects meanwhile sends its
    /// request again a moment later instead of being refused.
    pub(super) fn hold_until_listening(&self, name: &str, reclaimed: &Reclaimed) -> Option<Hold> {
        let ports: Vec<u16> = reclaimed.listeners.iter().map(SocketAddr::port).collect();
        hold_new_connections(self.deps.host.as_ref(), name, &ports)
    }

    /// Wakes reclaimed workload `name` now; returns once it runs (its memory may still be
    /// arriving).
    pub async fn wake(self: &Arc<Self>, name: &str, caller: Caller) -> Result<RestoreOutcome, PolicyError> {
        let w = self.own_workload(name, caller)?;
        let Some(reclaimed) = w.reclaimed else { return Err(PolicyError::NotReclaimed(name.into())) };
        let waker =
            self.workloads.read(name, |slot| slot.idle.waker.as_ref().map(|w| w.requests.clone())).flatten();
        let requests = match waker {
            Some(requests) => requests,
            None => self.arm_waker(name, reclaimed, None),
        };
        let (reply, answer) = oneshot::channel();
        requests.send(reply).map_err(|_| PolicyError::WokenElsewhere(name.into()))?;
        let woken = answer.await.map_err(|_| PolicyError::WokenElsewhere(name.into()))?;
        woken.map_err(|source| PolicyError::Wake { workload: name.into(), source })
    }

    /// Restores reclaimed workload `name` lazily; returns once it runs.
    async fn restore_reclaimed(
        self: &Arc<Self>,
        name: &str,
        reclaimed: &Reclaimed,
    ) -> Result<RestoreOutcome, WakeFailure> {
        let local = |what| move |e: std::io::Error| Arc::new(RestoreError::Local { what, source: e });
        // Not reclaimed while it is restored: a restore refuses reclaimed workloads.
        self.registry.update(name, |w| w.reclaimed = None).map_err(local("workload registry"))?;
        let (running, ran) = oneshot::channel();
        let params = RestoreParams {
            target: RestoreTarget::Checkpoint(reclaimed.checkpoint.clone()),
            gpu_map: Vec::new(),
            lazy: true,
            tcp_close: false,
            on_running: Some(Box::new(move |outcome| {
                let _ = running.send(outcome);
            })),
            caller: Caller::Root,
            as_workload: None,
            into: None,
        };
        let engine = self.clone();
        let mut job = tokio::spawn(async move { engine.restore(params, Arc::new(|_| {})).await });
        let joined = |done: Result<Result<RestoreOutcome, RestoreError>, tokio::task::JoinError>| {
            done.map_err(|e| Arc::new(RestoreError::panicked("restore task")(e)))?.map_err(Arc::new)
        };
        let result = tokio::select! {
            ran = ran => match ran {
                Ok(outcome) => Ok(outcome),
                // Ended before the tree ran: its result says why.
                Err(_) => joined((&mut job).await),
            },
            done = &mut job => joined(done),
        };
        if let Err(e) = &result {
            let why = crate::error_chain(e.as_ref());
            let back = self.registry.update(name, |w| {
                w.reclaimed = Some(reclaimed.clone());
                w.last_error = Some(why);
            });
            if let Err(e) = back {
                warn!(workload = name, error = %e, "cannot record the workload as still reclaimed");
            }
        }
        result
    }
}

/// The waker's life: listen and watch, wake on the first use, relay what was accepted;
/// listen again after a failed wake. Ends with the engine, or once the workload runs.
async fn wait_and_wake(
    engine: Weak<Engine>,
    host: Arc<dyn Host>,
    name: String,
    reclaimed: Reclaimed,
    mut asked: mpsc::UnboundedReceiver<WakeReply>,
    mut held: Option<Hold>,
) {
    loop {
        let Some(Wanted { accepted, mut replies, hold }) =
            wait_for_use(host.as_ref(), &name, &reclaimed, &mut asked, held.take()).await
        else {
            return;
        };
        let started = Instant::now();
        let Some(engine) = engine.upgrade() else { return };
        engine.workloads.with(&name, |slot| slot.idle.waking = true);
        let woken = engine.restore_reclaimed(&name, &reclaimed).await;
        engine.workloads.with(&name, |slot| slot.idle.waking = false);
        engine.metrics.reclaim(if woken.is_ok() { "woken" } else { "wake_failed" });
        while let Ok(reply) = asked.try_recv() {
            replies.push(reply);
        }
        match woken {
            Ok(outcome) => {
                // The restored tree's listeners take new connections from here.
                drop(hold);
                info!(workload = %name, pid = outcome.pid, wake_ms = started.elapsed().as_millis() as u64, relayed = accepted.len(), "reclaimed workload runs again");
                engine.workloads.with(&name, |slot| {
                    slot.idle.waker = None;
                    slot.idle.restart_clock();
                });
                for (stream, addr) in accepted {
                    tokio::spawn(relay(stream, addr));
                }
                replies.into_iter().for_each(|r| drop(r.send(Ok(outcome.clone()))));
                return;
            }
            Err(e) => {
                warn!(workload = %name, error = %crate::error_chain(e.as_ref()), "waking failed; the workload stays reclaimed");
                replies.into_iter().for_each(|r| drop(r.send(Err(e.clone()))));
                drop(accepted);
                // Held until the waker listens again.
                held = hold;
                tokio::time::sleep(RETRY_AFTER).await;
            }
        }
    }
}

/// What a wake has to answer: connections accepted on the workload's behalf, and callers of
/// `stasis wake`.
struct Wanted {
    accepted: Vec<(TcpStream, SocketAddr)>,
    replies: Vec<WakeReply>,
    /// New connections held back while nothing listens.
    hold: Option<Hold>,
}

/// Listens on the workload's addresses and watches its ports until the first use: a
/// connection, a segment on a held connection, or a request; `previous` (a failed wake's
/// hold) ends once the waker listens. `None` once nobody can ask any more (the engine is
/// gone).
async fn wait_for_use(
    host: &dyn Watches,
    name: &str,
    reclaimed: &Reclaimed,
    asked: &mut mpsc::UnboundedReceiver<WakeReply>,
    previous: Option<Hold>,
) -> Option<Wanted> {
    let listeners = listen_on(name, &reclaimed.listeners).await;
    drop(previous);
    let mut uses =
        UseWatch::open(host, name, &reclaimed.ports, &reclaimed.connections, "while it is reclaimed");
    let trigger = tokio::select! {
        // A connection first: a segment seen may be its SYN.
        biased;
        (stream, addr) = accept_any(&listeners) => Trigger::Connection(stream, addr),
        port = uses.next() => Trigger::Segment(port),
        reply = asked.recv() => Trigger::Asked(reply?),
    };
    let ports: Vec<u16> = listeners.iter().map(|(_, addr)| addr.port()).collect();
    let hold = hold_new_connections(host, name, &ports);
    let mut wanted = Wanted { accepted: Vec::new(), replies: Vec::new(), hold };
    match trigger {
        Trigger::Connection(stream, addr) => {
            info!(workload = %name, listener = %addr, "connection to a reclaimed workload; waking it");
            wanted.accepted.push((stream, addr));
        }
        Trigger::Segment(port) => info!(workload = %name, port, "traffic to a reclaimed workload; waking it"),
        Trigger::Asked(reply) => {
            info!(workload = %name, "waking a reclaimed workload on request");
            wanted.replies.push(reply);
        }
    }
    // Connections already waiting would be reset once the listeners close.
    if wanted.hold.is_some() {
        tokio::time::sleep(HANDSHAKES_SETTLE).await;
    }
    for (listener, addr) in listeners {
        wanted.accepted.extend(waiting(listener).into_iter().map(|stream| (stream, addr)));
    }
    Some(wanted)
}

/// Holds back new connections to `ports` (logged when it cannot: they are then refused while
/// nothing listens).
fn hold_new_connections(host: &dyn Watches, name: &str, ports: &[u16]) -> Option<Hold> {
    static HOLDS: AtomicU64 = AtomicU64::new(0);
    if ports.is_empty() {
        return None;
    }
    let table = format!("stasis-wake-{}-{}", std::process::id(), HOLDS.fetch_add(1, Ordering::Relaxed));
    (host.hold_new_connections(&table, ports))
        .inspect_err(|e| warn!(workload = name, error = %e, "cannot hold back new connections while nothing listens; some may be refused"))
        .ok()
}

/// A listener on each of `addrs`. An address in use is tried again for [`ADDRESS_FREED_WAIT`]:
/// the reclaimed tree's own listener may still be closing (its last descriptor goes with the
/// killed processes' exit, or with the dumping CRIU's copy). One still taken then (another
/// process took it meanwhile) is skipped, logged: its port is still watched for traffic.
pub(super) async fn listen_on(name: &str, addrs: &[SocketAddr]) -> Vec<(TcpListener, SocketAddr)> {
    let bind = |addr: SocketAddr| -> std::io::Result<TcpListener> {
        let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        socket.listen(1024)
    };
    let deadline = Instant::now() + ADDRESS_FREED_WAIT;
    let mut listeners = Vec::new();
    for &addr in addrs {
        loop {
            match bind(addr) {
                Ok(listener) => listeners.push((listener, addr)),
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                    tokio::time::sleep(ADDRESS_RETRY).await;
                    continue;
                }
                Err(e) => {
                    warn!(workload = name, address = %addr, error = %e, "cannot listen for a reclaimed workload");
                }
            }
            break;
        }
    }
    listeners
}

/// The connections waiting in `listener`'s backlog, taken without waiting (the reactor may
/// not have seen them yet); the listener is closed afterwards.
fn waiting(listener: TcpListener) -> Vec<TcpStream> {
    let Ok(listener) = listener.into_std() else { return Vec::new() };
    let mut streams = Vec::new();
    while let Ok((stream, _)) = listener.accept() {
        match stream.set_nonblocking(true).and_then(|()| TcpStream::from_std(stream)) {
            Ok(stream) => streams.push(stream),
            Err(e) => debug!(error = %e, "a waiting connection could not be taken over"),
        }
    }
    streams
}

/// The first connection accepted on any of `listeners` (never, without listeners).
async fn accept_any(listeners: &[(TcpListener, SocketAddr)]) -> (TcpStream, SocketAddr) {
    if listeners.is_empty() {
        return std::future::pending().await;
    }
    loop {
        let accepts = listeners.iter().map(|(l, addr)| Box::pin(async move { (l.accept().await, *addr) }));
        let ((accepted, addr), _, _) = futures::future::select_all(accepts).await;
        match accepted {
            Ok((stream, _)) => return (stream, addr),
            Err(e) => {
                debug!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Carries a connection the waker accepted to the restored listener at `listener`.
async fn relay(mut client: TcpStream, listener: SocketAddr) {
    let target = match listener.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), listener.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), listener.port()),
        _ => listener,
    };
    let deadline = Instant::now() + LISTENER_WAIT;
    let mut upstream = loop {
        match TcpStream::connect(target).await {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => {
                warn!(listener = %target, error = %e, "cannot reach the woken workload; closing a relayed connection");
                return;
            }
        }
    };
    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
}
