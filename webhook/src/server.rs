//! The webhook's HTTPS server: `POST /mutate` answers AdmissionReviews, `GET /healthz` says it
//! runs. The API server only talks TLS to webhooks; the certificate and key come from files
//! (a mounted secret).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tracing::{info, warn};

use crate::mutate::Sizing;
use crate::review;

/// The largest AdmissionReview read (the API server sends far less).
const MAX_BODY: usize = 8 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot read the TLS certificate {0}")]
    Cert(PathBuf, #[source] rustls::pki_types::pem::Error),
    #[error("cannot read the TLS key {0}")]
    Key(PathBuf, #[source] rustls::pki_types::pem::Error),
    #[error("the TLS certificate and key do not go together")]
    Tls(#[from] rustls::Error),
    #[error("cannot listen on {0}")]
    Listen(SocketAddr, #[source] std::io::Error),
}

/// The server's TLS settings, from PEM files.
pub fn tls(cert: &Path, key: &Path) -> Result<TlsAcceptor, ServerError> {
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| ServerError::Cert(cert.to_path_buf(), e))?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| ServerError::Key(key.to_path_buf(), e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Serves on `listen` until the task is dropped.
pub async fn serve(listen: SocketAddr, acceptor: TlsAcceptor, sizing: Sizing) -> Result<(), ServerError> {
    let listener = TcpListener::bind(listen).await.map_err(|e| ServerError::Listen(listen, e))?;
    info!(%listen, "stasis-webhook listening");
    let sizing = Arc::new(sizing);
    loop {
        let Ok((tcp, peer)) = listener.accept().await else { continue };
        let (acceptor, sizing) = (acceptor.clone(), sizing.clone());
        tokio::spawn(async move {
            let tls = match acceptor.accept(tcp).await {
                Ok(tls) => tls,
                Err(e) => return warn!(%peer, error = %e, "TLS handshake failed"),
            };
            let service = hyper::service::service_fn(move |request| handle(request, sizing.clone()));
            if let Err(e) =
                hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tls), service).await
            {
                warn!(%peer, error = %e, "connection failed");
            }
        });
    }
}

async fn handle(
    request: Request<Incoming>,
    sizing: Arc<Sizing>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let reply = |status: StatusCode, body: String| {
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        Ok(response)
    };
    match (request.method(), request.uri().path()) {
        (&Method::GET, "/healthz") => reply(StatusCode::OK, "ok\n".into()),
        (&Method::POST, "/mutate") => {
            let body = match Limited::new(request.into_body(), MAX_BODY).collect().await {
                Ok(body) => body.to_bytes(),
                Err(e) => return reply(StatusCode::BAD_REQUEST, format!("cannot read the request: {e}\n")),
            };
            match review::answer(&body, &sizing) {
                Ok(answer) => reply(StatusCode::OK, answer.to_string()),
                Err(e) => reply(StatusCode::BAD_REQUEST, format!("{e}\n")),
            }
        }
        _ => reply(StatusCode::NOT_FOUND, "POST /mutate, GET /healthz\n".into()),
    }
}
