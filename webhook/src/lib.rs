//! stasis-webhook: the mutating admission webhook that prepares pods opted in to stasis
//! (label `stasis.dev/checkpoint: "true"`): it records the pod's owner for the NRI plugin,
//! runs each container's command under stasis-pod, makes stasis-pod the preStop hook, and
//! raises the grace period to what the eviction checkpoint needs. AdmissionReview v1 JSON in,
//! JSONPatch out, over HTTPS with the certificate of a mounted secret.
#![forbid(unsafe_code)]

pub mod mutate;
pub mod owner;
pub mod quantity;
pub mod review;
pub mod server;
