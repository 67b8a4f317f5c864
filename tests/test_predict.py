import pytest

from marsched.predict import NoisyOracleLength, OracleApi, OracleLength, TypeMeanApi, parse_length_predictor
from marsched.workload import ApiCall, ApiType, build_request

REQUEST = build_request("r", 100, [(200, ApiCall(ApiType.MATH, 0.0001, 20)), (50, None)])


def test_oracle_gives_the_truth():
    assert OracleLength().predict(REQUEST, 0) == 200
    assert OracleApi().estimate(REQUEST, 0).duration_s == 0.0001


def test_noisy_predictions_are_repeatable_and_spread_with_sigma():
    noisy = NoisyOracleLength(0.3, seed=1)
    assert noisy.predict(REQUEST, 0) == NoisyOracleLength(0.3, seed=1).predict(REQUEST, 0)
    draws = [NoisyOracleLength(0.3, seed=s).predict(REQUEST, 0) for s in range(400)]
    relative = [d / 200 - 1 for d in draws]
    spread = (sum(x * x for x in relative) / len(relative)) ** 0.5
    assert 0.25 < spread < 0.35
    assert NoisyOracleLength(0.0).predict(REQUEST, 0) == 200


def test_parse_rejects_bad_specs():
    assert parse_length_predictor("noisy:0.3").name == "noisy:0.3"
    with pytest.raises(ValueError, match="valid: online, foreknowledge \\(a bound\\), oracle, noisy:SIGMA"):
        parse_length_predictor("magic")
    with pytest.raises(ValueError, match="must be a number"):
        parse_length_predictor("noisy:abc")


def test_type_mean_moves_from_prior_to_observations():
    estimator = TypeMeanApi(prior_duration_s=1.0)
    assert estimator.estimate(REQUEST, 0).duration_s == pytest.approx(1.0)
    for _ in range(20):
        estimator.observe(ApiType.MATH, 0.0001, 20)
    # Log-space mean: twenty 0.1 ms calls outweigh the 1 s prior by far.
    assert estimator.estimate(REQUEST, 0).duration_s < 0.001
    assert estimator.estimate(REQUEST, 0).return_tokens == 20


def test_declared_expectation_is_the_prior_for_its_type():
    estimator = TypeMeanApi()
    estimator.declare(ApiType.MATH, 0.001, 4)
    assert estimator.estimate(REQUEST, 0).duration_s == pytest.approx(0.001)
    estimator.observe(ApiType.MATH, 0.001, 4)
    estimator.declare(ApiType.MATH, 50.0, 4)  # once seen, a type keeps its own history
    assert estimator.estimate(REQUEST, 0).duration_s == pytest.approx(0.001)
