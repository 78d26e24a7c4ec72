//! The caller of a request, from the socket's `SO_PEERCRED` (tonic records it per connection).

use tonic::transport::server::UdsConnectInfo;
use tonic::{Request, Status};

use crate::engine::Caller;

/// Who sent `req`; a connection without credentials (none over a Unix socket) is refused.
pub fn caller_of<T>(req: &Request<T>) -> Result<Caller, Status> {
    let cred = req.extensions().get::<UdsConnectInfo>().and_then(|info| info.peer_cred);
    let cred = cred.ok_or_else(|| Status::permission_denied("the caller's credentials are unknown"))?;
    Ok(Caller::from_ids(cred.uid(), cred.gid()))
}
