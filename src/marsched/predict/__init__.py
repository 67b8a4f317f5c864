"""Predictions of segment output lengths and API durations."""

from marsched.predict.api_duration import ApiEstimate, ApiEstimator, OracleApi, TypeMeanApi, parse_api_estimator
from marsched.predict.length import LengthPredictor, NoisyOracleLength, OracleLength, parse_length_predictor
from marsched.predict.segment import SegmentPrediction, SegmentPredictor

__all__ = [
    "ApiEstimate",
    "ApiEstimator",
    "LengthPredictor",
    "NoisyOracleLength",
    "OracleApi",
    "OracleLength",
    "SegmentPrediction",
    "SegmentPredictor",
    "TypeMeanApi",
    "parse_api_estimator",
    "parse_length_predictor",
]
