//! AdmissionReview v1 in, AdmissionReview v1 out.

use base64::Engine as _;
use serde_json::{Value, json};

use crate::mutate::{Decision, Sizing, decide};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReviewError {
    #[error("not JSON: {0}")]
    NotJson(String),
    #[error("not an AdmissionReview with a request and its uid")]
    NotAReview,
}

/// The answer to AdmissionReview `body`.
pub fn answer(body: &[u8], sizing: &Sizing) -> Result<Value, ReviewError> {
    let review: Value = serde_json::from_slice(body).map_err(|e| ReviewError::NotJson(e.to_string()))?;
    let request = &review["request"];
    let uid = request["uid"].as_str().ok_or(ReviewError::NotAReview)?;
    let is_pod_creation = request["kind"]["kind"] == "Pod" && request["operation"] == "CREATE";
    let decision = match is_pod_creation {
        true => decide(&request["object"], sizing),
        false => Decision::Untouched,
    };
    let response = match decision {
        Decision::Untouched => json!({ "uid": uid, "allowed": true }),
        Decision::Patch { ops, warnings } => {
            let patch = base64::engine::general_purpose::STANDARD.encode(Value::Array(ops).to_string());
            json!({ "uid": uid, "allowed": true, "patchType": "JSONPatch", "patch": patch, "warnings": warnings })
        }
        Decision::Refuse(why) => json!({
            "uid": uid,
            "allowed": false,
            "status": { "code": 403, "message": format!("stasis: {why}") },
        }),
    };
    Ok(json!({ "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response }))
}
