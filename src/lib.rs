//! OxiFlow facade.
