//! Whether a cloud store can find credentials on this node. object_store falls back on the
//! cloud's metadata service (169.254.169.254, metadata.google.internal) when the environment
//! names none, and off that cloud the request fails with an answer that says nothing useful
//! (a 403 or a time-out) or, worse, reaches whatever answers at that address. So stasisd asks a
//! metadata service for credentials only on that cloud's own machines (the firmware says
//! which), and elsewhere refuses at start, naming the variables to set.

use std::path::Path;

use stasis_linux::cloud::Cloud;

/// The environment variables, any one of which gives a store of `cloud` credentials (or says
/// it needs none), as object_store reads them.
fn variables(cloud: Cloud) -> &'static [&'static str] {
    match cloud {
        Cloud::Aws => &[
            "AWS_ACCESS_KEY_ID",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "AWS_SKIP_SIGNATURE",
        ],
        Cloud::Gcp => &[
            "GOOGLE_SERVICE_ACCOUNT",
            "GOOGLE_SERVICE_ACCOUNT_PATH",
            "SERVICE_ACCOUNT",
            "GOOGLE_SERVICE_ACCOUNT_KEY",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "GOOGLE_SKIP_SIGNATURE",
        ],
        Cloud::Azure => &[
            "AZURE_STORAGE_ACCOUNT_KEY",
            "AZURE_STORAGE_ACCESS_KEY",
            "AZURE_STORAGE_SAS_KEY",
            "AZURE_STORAGE_SAS_TOKEN",
            "AZURE_STORAGE_TOKEN",
            "AZURE_CLIENT_SECRET",
            "AZURE_FEDERATED_TOKEN_FILE",
            "AZURE_STORAGE_USE_EMULATOR",
            "AZURE_SKIP_SIGNATURE",
            "AZURE_USE_AZURE_CLI",
        ],
    }
}

/// The cloud whose storage a store URL scheme names.
pub fn cloud_of(scheme: &str) -> Option<Cloud> {
    match scheme {
        "s3" | "s3a" => Some(Cloud::Aws),
        "gs" => Some(Cloud::Gcp),
        "az" | "azure" | "abfs" | "abfss" => Some(Cloud::Azure),
        _ => None,
    }
}

/// Why a store of `cloud` has no credentials on this node (which runs in `here`), if it has
/// none: no variable of [`variables`] is set (`env` looks them up), no gcloud default
/// credentials file is in `home`, and this is not a machine of that cloud.
pub fn missing(
    cloud: Cloud,
    env: impl Fn(&str) -> Option<String>,
    home: Option<&Path>,
    here: Option<Cloud>,
) -> Option<String> {
    let set = |name: &&str| env(name).is_some_and(|v| !v.is_empty());
    if variables(cloud).iter().any(set) || here == Some(cloud) {
        return None;
    }
    let gcloud = home.map(|h| h.join(".config/gcloud/application_default_credentials.json"));
    if cloud == Cloud::Gcp && gcloud.is_some_and(|f| f.is_file()) {
        return None;
    }
    Some(format!(
        "no {} credentials: set one of {} (this node is {}, so its metadata service is not asked)",
        cloud.name(),
        variables(cloud).join(", "),
        here.map_or("on no cloud".to_string(), |c| format!("on {}", c.name()))
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(set: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| set.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    }

    #[test]
    fn a_store_without_credentials_off_its_cloud_is_refused_naming_the_variables() {
        let why = missing(Cloud::Gcp, env(&[]), None, None).unwrap();
        assert!(why.starts_with("no gcp credentials: set one of GOOGLE_SERVICE_ACCOUNT, "), "{why}");
        assert!(why.contains("GOOGLE_APPLICATION_CREDENTIALS") && why.ends_with("is not asked)"), "{why}");
        assert!(
            missing(Cloud::Aws, env(&[]), None, Some(Cloud::Gcp)).unwrap().contains("this node is on gcp")
        );
        assert!(
            missing(Cloud::Azure, env(&[("AZURE_STORAGE_ACCOUNT_KEY", "")]), None, None).is_some(),
            "empty is unset"
        );
    }

    #[test]
    fn a_variable_a_credentials_file_or_the_clouds_own_machine_is_enough() {
        assert_eq!(missing(Cloud::Aws, env(&[("AWS_ACCESS_KEY_ID", "k")]), None, None), None);
        assert_eq!(missing(Cloud::Aws, env(&[("AWS_WEB_IDENTITY_TOKEN_FILE", "/t")]), None, None), None);
        assert_eq!(missing(Cloud::Azure, env(&[("AZURE_FEDERATED_TOKEN_FILE", "/t")]), None, None), None);
        assert_eq!(missing(Cloud::Gcp, env(&[]), None, Some(Cloud::Gcp)), None);
        let home = tempfile::tempdir().unwrap();
        assert!(missing(Cloud::Gcp, env(&[]), Some(home.path()), None).is_some());
        std::fs::create_dir_all(home.path().join(".config/gcloud")).unwrap();
        std::fs::write(home.path().join(".config/gcloud/application_default_credentials.json"), "{}")
            .unwrap();
        assert_eq!(missing(Cloud::Gcp, env(&[]), Some(home.path()), None), None);
        assert_eq!(cloud_of("abfss"), Some(Cloud::Azure));
        assert_eq!(cloud_of("file"), None);
    }
}
