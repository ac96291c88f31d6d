//! The closed set of device types a placement can name.

use std::fmt;
use std::str::FromStr;

use crate::PlacementError;

/// Where the local pieces of a global tensor live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceType {
    Cpu,
    Cuda,
}

impl DeviceType {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceType::Cpu => "cpu",
            DeviceType::Cuda => "cuda",
        }
    }
}

impl fmt::Display for DeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DeviceType {
    type Err = PlacementError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "cpu" => Ok(DeviceType::Cpu),
            "cuda" | "gpu" => Ok(DeviceType::Cuda),
            other => Err(PlacementError::UnknownDevice(other.to_string())),
        }
    }
}
