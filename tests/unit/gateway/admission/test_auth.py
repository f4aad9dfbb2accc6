"""API keys: hashed storage, 401 / 403, env keys, admin token separation."""

from __future__ import annotations

import pytest

from kiloserve.errors import ConfigError, ForbiddenError, UnauthorizedError
from kiloserve.gateway.admission.auth import AuthConfig, KeyStore, hash_key


def _store(**env: str) -> KeyStore:
    cfg = AuthConfig.model_validate(
        {
            "keys": [
                {"name": "alice", "key_sha256": hash_key("sk-alice"), "allowed_models": ["m"]},
                {"name": "bob", "key_env": "BOB_KEY", "priority": 2},
            ]
        }
    )
    return KeyStore(cfg, admin_token="admin-secret", env={"BOB_KEY": "sk-bob", **env})


def test_known_keys_authenticate_by_name() -> None:
    store = _store()
    alice = store.authenticate("Bearer sk-alice")
    bob = store.authenticate("Bearer sk-bob")
    assert alice is not None and alice.name == "alice"
    assert bob is not None and (bob.name, bob.priority) == ("bob", 2)


def test_unknown_or_missing_key_is_401() -> None:
    store = _store()
    for header in (None, "", "Basic x", "Bearer sk-nope", "Bearer admin-secret"):
        with pytest.raises(UnauthorizedError) as info:
            store.authenticate(header)
        assert info.value.status == 401


def test_model_not_allowed_is_403() -> None:
    alice = _store().authenticate("Bearer sk-alice")
    KeyStore.check_model(alice, "m")
    with pytest.raises(ForbiddenError) as info:
        KeyStore.check_model(alice, "other")
    assert info.value.status == 403 and "other" in info.value.message


def test_keys_are_stored_hashed_only() -> None:
    store = _store()
    assert "sk-alice" not in repr(store.__dict__) and "sk-bob" not in repr(store.__dict__)


def test_auth_is_off_without_keys() -> None:
    store = KeyStore(AuthConfig(), env={})
    assert not store.is_enabled
    assert store.authenticate(None) is None


def test_missing_env_key_and_admin_reuse_are_config_errors() -> None:
    cfg = AuthConfig.model_validate({"keys": [{"name": "x", "key_env": "NOPE"}]})
    with pytest.raises(ConfigError, match="NOPE"):
        KeyStore(cfg, env={})
    same = AuthConfig.model_validate({"keys": [{"name": "x", "key_sha256": hash_key("adm")}]})
    with pytest.raises(ConfigError, match="admin"):
        KeyStore(same, admin_token="adm", env={})


def test_a_key_needs_exactly_one_source() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        AuthConfig.model_validate({"keys": [{"name": "x"}]})
