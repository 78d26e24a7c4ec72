//! Which cloud this machine runs in, as its firmware tells (DMI strings under
//! /sys/class/dmi/id): the preemption-notice watcher asks that cloud's metadata service, and
//! the store asks a cloud's metadata service for credentials only on that cloud's machines.
//! Each cloud's metadata address and notice window are facts of that cloud, kept here with it.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A cloud stasisd knows the metadata service of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Cloud {
    Aws,
    Gcp,
    Azure,
}

impl Cloud {
    pub fn name(self) -> &'static str {
        match self {
            Self::Aws => "aws",
            Self::Gcp => "gcp",
            Self::Azure => "azure",
        }
    }

    /// The metadata service's address on the cloud's own machines.
    pub fn default_base_url(self) -> &'static str {
        match self {
            Self::Aws | Self::Azure => "http://169.254.169.254",
            Self::Gcp => "http://metadata.google.internal",
        }
    }

    /// How long a preemption notice gives before the machine goes.
    pub fn notice_window(self) -> Duration {
        match self {
            Self::Aws => Duration::from_secs(120),
            Self::Gcp | Self::Azure => Duration::from_secs(30),
        }
    }

    /// The machine's cloud, from the firmware's DMI strings; `None` elsewhere.
    pub fn detect() -> Option<Self> {
        let read =
            |name: &str| std::fs::read_to_string(format!("/sys/class/dmi/id/{name}")).unwrap_or_default();
        Self::from_dmi(&read("sys_vendor"), &read("product_name"), &read("chassis_asset_tag"))
    }

    fn from_dmi(vendor: &str, product: &str, asset_tag: &str) -> Option<Self> {
        let (vendor, product) = (vendor.trim(), product.trim());
        if vendor == "Amazon EC2" || product.starts_with("Amazon EC2") {
            Some(Self::Aws)
        } else if vendor == "Google" || product == "Google Compute Engine" {
            Some(Self::Gcp)
        } else if asset_tag.trim() == AZURE_ASSET_TAG {
            Some(Self::Azure)
        } else {
            None
        }
    }
}

/// The chassis asset tag every Azure VM reports.
const AZURE_ASSET_TAG: &str = "7783-7084-3265-9085-8269-3286-77";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cloud_is_told_by_its_firmware_strings() {
        assert_eq!(Cloud::from_dmi("Amazon EC2\n", "m5.large\n", ""), Some(Cloud::Aws));
        assert_eq!(Cloud::from_dmi("Google\n", "Google Compute Engine\n", ""), Some(Cloud::Gcp));
        let azure =
            Cloud::from_dmi("Microsoft Corporation\n", "Virtual Machine\n", &format!("{AZURE_ASSET_TAG}\n"));
        assert_eq!(azure, Some(Cloud::Azure));
        // Hyper-V on a desk is not Azure.
        assert_eq!(Cloud::from_dmi("Microsoft Corporation", "Virtual Machine", "None"), None);
        assert_eq!(Cloud::from_dmi("QEMU", "Standard PC (Q35 + ICH9, 2009)", ""), None);
    }
}
