//! The partition: whose policy state a pipeline keeps.
//!
//! A partition names an application, an environment, a subject (the
//! dependency being protected, never a credential) and optionally a tenant.
//! Every policy of a pipeline shares the pipeline's partition, and a context
//! is accepted only by pipelines of the partition that created it.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids;

/// Application, environment, subject and optional tenant.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Partition {
    application: String,
    environment: String,
    subject: String,
    tenant: Option<String>,
}

impl Partition {
    /// A partition without a tenant; each part is checked like an id.
    pub fn new(application: &str, environment: &str, subject: &str) -> Result<Self, ids::Error> {
        ids::check("partition application", application)?;
        ids::check("partition environment", environment)?;
        ids::check("partition subject", subject)?;
        Ok(Partition {
            application: application.to_owned(),
            environment: environment.to_owned(),
            subject: subject.to_owned(),
            tenant: None,
        })
    }

    /// The same partition narrowed to one tenant.
    pub fn with_tenant(mut self, tenant: &str) -> Result<Self, ids::Error> {
        ids::check("partition tenant", tenant)?;
        self.tenant = Some(tenant.to_owned());
        Ok(self)
    }

    /// The application, e.g. `shop`.
    pub fn application(&self) -> &str {
        &self.application
    }

    /// The environment, e.g. `prod`.
    pub fn environment(&self) -> &str {
        &self.environment
    }

    /// The protected dependency, e.g. `catalog-api`.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The tenant, when limits are kept per tenant.
    pub fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }
}

impl fmt::Display for Partition {
    /// `application/environment/subject[/tenant]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}/{}",
            self.application, self.environment, self.subject
        )?;
        if let Some(tenant) = &self.tenant {
            write!(f, "/{tenant}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_differ_by_tenant() {
        // Goal: the tenant is part of the partition's identity.
        // Method: compare a partition with and without a tenant and print both.
        let plain = Partition::new("shop", "prod", "catalog-api").unwrap();
        let tenant = plain.clone().with_tenant("acme").unwrap();
        assert_ne!(plain, tenant);
        assert_eq!(plain.to_string(), "shop/prod/catalog-api");
        assert_eq!(tenant.to_string(), "shop/prod/catalog-api/acme");
        assert!(Partition::new("shop", "", "x").is_err());
    }
}
